"""Transformers MoE models trained at ep 2 x edp 2 (world 4) under ZeRO-1 and ZeRO-3, and
their checkpoints (``parallel.zero.stage``, ``checkpoint.expert_layout``).

Parity: 20 AdamW steps of tiny Mixtral and Qwen2-MoE (8 experts, top-2, auxiliary loss
on, ``tests.distributed.test_moe.tiny_causal_lm``), gradient clipping by the global norm
active, each of the 4 ranks on its own rows (so each routes differently). The per-step loss
(auxiliary loss included), the global gradient norm and the whole model (expert slices
gathered over ep) after 20 steps are within ``trajectory(1e-2, 20)`` relative (the
gradient norms within ``composed(trajectory, 2)``; ``tests/tolerance.py``) of one
process on the global batch with ``clip_grad_norm_``: fp32, the only difference is
summation order (the
all-to-all moves rows without rounding them; ranks' gradients are summed over dp and edp
instead of inside one backward). ZeRO-3 shards every weight (persistence threshold 0), the
experts over edp.

Checkpoint: saved at ep 2 x edp 2 ZeRO-3 after 3 steps; ``consolidate`` into a folder that
``transformers``' ``from_pretrained`` loads to exactly the trained weights (all 8 experts
of every layer at their global index), and ``load_checkpoint`` at ep 1 (world 2, ZeRO-1)
gives back exactly the same weights.
"""

from __future__ import annotations

import torch

from tests.distributed.test_moe import tiny_causal_lm
from tests.distributed.training import max_rel_diff
from tests.harness import run_ranks
from tests.tolerance import check, composed, trajectory

STEPS, ROWS, LR, CLIP = 20, 2, 1e-2, 0.085
TOL = trajectory(LR, STEPS)
FAMILIES = ("mixtral", "qwen2_moe")


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(300 + step))


def _config(stage: int, ep: int, rows: int = ROWS) -> dict:
    return {
        "train_micro_batch_size_per_gpu": rows,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": {"expert_parallel_size": ep},
        "steps_per_print": 1000,
        "loss": {"global_aux_loss": True},  # compared with one process on the whole batch
    }


def _whole_state(engine) -> dict:
    """The one-process state dict: expert slices all-gathered over ep."""
    import torch.distributed as dist

    from meshtrain.parallel.experts import is_expert_param

    experts = {n for n, p in engine.module.named_parameters() if is_expert_param(p)}
    ep = engine.topology.group("ep")
    state = {}
    for name, t in engine.module_state_dict().items():
        if name in experts and ep.size > 1:
            parts = [torch.empty_like(t) for _ in range(ep.size)]
            dist.all_gather(parts, t.contiguous(), group=ep.pg)
            t = torch.cat(parts)
        state[name] = t.detach().clone()
    return state


def _engine(fam: str, stage: int, ep: int, rows: int = ROWS):
    import meshtrain

    model = tiny_causal_lm(fam)
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, ep, rows)
    )
    return engine


def _train(engine, first: int, steps: int, rows: int = ROWS):
    import torch.distributed as dist

    topo = engine.topology
    dp, r = topo.replica_group.size, topo.replica_group.rank
    losses, norms, routed = [], [], []
    for step in range(first, first + steps):
        ids = _batch(step, rows * dp)[rows * r : rows * (r + 1)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / topo.world_size)
        norms.append(engine.get_global_grad_norm())
        routed.append(engine.module.model.layers[0].mlp.experts.last_counts.tolist())
    return losses, norms, routed


def _parity(stages) -> dict:
    out = {}
    for fam in FAMILIES:
        for stage in stages:
            engine = _engine(fam, stage, 2)
            assert engine.zero.experts is not None  # the expert part, over edp
            losses, norms, routed = _train(engine, 0, STEPS)
            bytes_edp = sum(
                n for (op, g), n in engine._step_comm.items() if g == "edp" and op != "control"
            )
            out[fam, stage] = {
                "losses": losses,
                "norms": norms,
                "state": _whole_state(engine),
                "routed": routed[0],
                "edp_bytes": bytes_edp,
                "edp_theory": engine.zero.comm_bytes_by_group()["edp"],
            }
    return out


def _reference(fam: str, rows: int, steps: int = STEPS):
    model = tiny_causal_lm(fam)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for step in range(steps):
        ids = _batch(step, rows)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _norm(state: dict) -> float:
    return sum(float(v.double().pow(2).sum()) for v in state.values()) ** 0.5


def test_training_parity_ep2_edp2_zero1_zero3():
    """ep 2 x edp 2 on 4 ranks, ZeRO-1 and ZeRO-3, 20 steps, against one process
    (module docstring)."""
    stages = (1, 3)
    results = run_ranks(_parity, 4, stages, timeout=600)
    for fam in FAMILIES:
        ref_losses, ref_norms, ref_state = _reference(fam, ROWS * 4)
        assert max(ref_norms) > CLIP, "clipping must be active for the test to mean anything"
        for stage in stages:
            for rank, res in enumerate(results):
                c, where = res[fam, stage], (fam, stage, rank)
                loss = max(abs(a - b) / b for a, b in zip(c["losses"], ref_losses, strict=True))
                check(f"{where} loss", loss, TOL)
                norm = max(abs(a - b) / b for a, b in zip(c["norms"], ref_norms, strict=True))
                check(f"{where} grad norm", norm, composed(TOL, 2))
                check(f"{where} model", max_rel_diff(c["state"], ref_state), TOL)
                norm_diff = abs(_norm(c["state"]) - _norm(ref_state)) / _norm(ref_state)
                check(f"{where} model norm", norm_diff, TOL)
                assert c["edp_bytes"] == c["edp_theory"] > 0, (where, c["edp_bytes"])
            routes = {str(res[fam, stage]["routed"]) for res in results}
            assert len(routes) > 1, (fam, stage)  # the ranks routed differently
        assert max_rel_diff(ref_state, tiny_causal_lm(fam).state_dict()) > 1e-2  # it trained


ACC_STEPS = 6


def _accelerate(stages) -> dict:
    """The Accelerator's documented loop at ep 2 (world 2): prepare, backward,
    ``clip_grad_norm_`` (the global norm over both kinds), step, zero_grad."""
    from meshtrain import Accelerator

    out = {}
    for stage in stages:
        acc = Accelerator(
            config={
                "mesh": {"expert_parallel_size": 2},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "loss": {"global_aux_loss": True},  # compared with one process on the whole batch
            },
            cpu=True,
        )
        model = tiny_causal_lm("mixtral")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        model, opt = acc.prepare(model, opt)
        r, dp = acc.process_index, acc.num_processes
        norms = []
        for step in range(ACC_STEPS):
            ids = _batch(step, ROWS * dp)[ROWS * r : ROWS * (r + 1)]
            acc.backward(model(input_ids=ids, labels=ids).loss)
            norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
        out[stage] = {"norms": norms, "state": _whole_state(model.engine)}
    return out


def test_accelerator_loop_ep2_clips_by_the_global_norm():
    """ZeRO-0 and ZeRO-3 at ep 2 through the Accelerator: every step's returned norm and
    the whole model after 6 steps within ``trajectory(1e-2, 6)`` (the norms within
    ``composed`` of it) of one process with clip_grad_norm_."""
    results = run_ranks(_accelerate, 2, (0, 3), timeout=600)
    _, ref_norms, ref_state = _reference("mixtral", ROWS * 2, ACC_STEPS)
    assert max(ref_norms) > CLIP
    tol = trajectory(LR, ACC_STEPS)
    for rank, res in enumerate(results):
        for stage, c in res.items():
            for step, (got, want) in enumerate(zip(c["norms"], ref_norms, strict=True)):
                check(
                    f"rank {rank} stage {stage} norm {step}",
                    abs(got - want) / want,
                    composed(tol, 2),
                )
            check(f"rank {rank} stage {stage} model", max_rel_diff(c["state"], ref_state), tol)


def _save_and_export(save_dir: str, export: str) -> dict:
    import torch.distributed as dist

    from meshtrain.checkpoint import consolidate

    engine = _engine("qwen2_moe", 3, 2)
    _train(engine, 0, 3)
    engine.save_checkpoint(save_dir)
    state = _whole_state(engine)
    dist.barrier()
    if dist.get_rank() == 0:
        consolidate(save_dir, export)
    dist.barrier()
    return state


def _load_at_ep1(save_dir: str) -> dict:
    engine = _engine("qwen2_moe", 1, 1, rows=2 * ROWS)
    engine.load_checkpoint(save_dir)
    return _whole_state(engine)


def test_checkpoint_reshards_to_ep1_and_exports_save_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    save_dir, export = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    saved = run_ranks(_save_and_export, 4, save_dir, export, timeout=600)[0]
    loaded = AutoModelForCausalLM.from_pretrained(export).state_dict()
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert loaded[gate_up].shape[0] == 8  # every expert, not one ep rank's 4
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    again = run_ranks(_load_at_ep1, 2, save_dir)[0]
    for k, v in saved.items():
        assert torch.equal(again[k], v), k
