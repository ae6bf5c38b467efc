"""Pipeline parallelism of mixture-of-experts models (gloo), against one process.

The single-process reference is defined as what the pipeline computes: the step's ``m``
micro-batches (each the union of every data-parallel replica's rows) run one after the
other with gradient accumulation, each micro-batch's loss being the model's own loss of
that micro-batch (cross-entropy + ``coef x`` the router's load-balancing loss over *every*
layer's router logits, which is not a sum of per-layer terms), the gradient that of the
mean over micro-batches, then one AdamW step. The pipeline carries the router sums
across its stages (``parallel.pipeline.router_aux``), so the two must agree.

Tolerance ``trajectory(lr, 20)`` (``tests/tolerance.py``) relative for the per-step loss
(aux included) and the whole-model parameter norm, and ``per_tensor`` of it for every
parameter (normwise), after 20 fp32 AdamW steps: the pipeline
adds the layers' router sums in the same order as one process, but the data-parallel
average, the all-to-all's regrouping of expert rows and the split backward sum fp32
values in another order (the same rule as the ep-only tests, ``test_moe.py``).
Bytes are exact: each rank's ``all_to_all`` on ``ep`` per step equals
``2 (N k + R) H 4`` summed over its stage's layers and the step's micro-batches, and its
``pp_p2p`` ``M (2 (b t H + 2 E + 6) 4 + 80)`` (activation and gradient with the router
sums, an 80-byte header).
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.tolerance import check, per_tensor, trajectory

STEPS = 20
M = 4  # micro-batches per step
ROWS = 2  # rows per micro-batch and replica
SEQ = 8


def _decoder():
    """meshtrain's Decoder with model.moe, 4 blocks (so interleaved 1F1B has 4 stages):
    8 routed experts (top-2) + 1 shared, aux coefficient 0.02."""
    from meshtrain.models import Decoder, DecoderConfig

    moe = dict(
        n_experts=8, top_k=2, n_shared_experts=1, expert_ffn_dim=12, router_aux_loss_coef=0.02
    )
    cfg = DecoderConfig(
        vocab_size=64, dim=16, n_layers=4, n_heads=2, ffn_dim=24, max_seq_len=16, seed=5, moe=moe
    )
    return Decoder(cfg)


def _make(fam: str):
    if fam == "decoder":
        return _decoder()
    from tests.distributed.test_moe import tiny_causal_lm

    if fam == "qwen3_moe":
        return tiny_causal_lm("qwen3_moe", num_hidden_layers=4, norm_topk_prob=True)

    if fam == "mixtral_one_expert":  # every token to experts 0 and 1, on every rank
        return tiny_causal_lm("mixtral", skew="one_expert", num_hidden_layers=4)
    return tiny_causal_lm(fam, num_hidden_layers=4)


def _lr(fam: str) -> float:
    return 1e-3 if fam == "decoder" else 1e-2  # as test_moe.py (its _lr says why)


def _micro_batches(step: int, dp: int, part: int | None):
    """The step's M micro-batches; ``part``: one replica's rows (None: every replica's)."""
    import torch

    g = torch.Generator().manual_seed(300 + step)
    out = []
    for _ in range(M):
        ids = torch.randint(0, 64, (ROWS * dp, SEQ), generator=g)
        if part is not None:
            ids = ids[ROWS * part : ROWS * (part + 1)]
        out.append({"input_ids": ids, "labels": ids})
    return out


def _reference(fam: str, dp: int) -> tuple[list[float], dict]:
    """One process: each step M micro-batches of all replicas' rows, each loss / M
    backward (gradient accumulation), one AdamW step."""
    import torch

    model = _make(fam)
    opt = torch.optim.AdamW(model.parameters(), lr=_lr(fam), weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for b in _micro_batches(step, dp, None):
            out = model(**b)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    model.eval()
    with torch.no_grad():
        out = [model(**b) for b in _micro_batches(99, dp, None)]
    evals = [(o if isinstance(o, torch.Tensor) else o.loss).item() for o in out]
    losses.append(sum(evals) / M)  # the evaluation after training, last
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _whole_state(engine) -> dict:
    """This rank's parameters under the model's names, expert slices gathered over ep."""
    import torch
    import torch.distributed as dist

    from meshtrain.parallel.experts import is_expert_param

    state = {}
    for stage in engine.module.stages.values():
        for name, p in stage.names.items():
            t = p.detach()
            if is_expert_param(p):
                eg = engine.topology.group("ep")
                parts = [torch.empty_like(t) for _ in range(eg.size)]
                dist.all_gather(parts, t.contiguous(), group=eg.pg)
                t = torch.cat(parts)
            state[name] = t.clone()
    return state


def _pipeline_run(
    fam: str,
    ep: int,
    schedule: str,
    virtual: int,
    zero: int,
    save_dir: str | None = None,
    checkpointing: bool = False,
) -> dict:
    import torch
    import torch.distributed as dist

    import meshtrain
    from meshtrain.parallel.experts.routed import RoutedExperts

    torch.set_num_threads(1)
    model = _make(fam)
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": M,
        "optimizer": {"type": "AdamW", "params": {"lr": _lr(fam), "weight_decay": 0.01}},
        "zero_optimization": {"stage": zero},
        "mesh": {"pipeline_parallel_size": 2, "expert_parallel_size": ep},
        "pipeline": {"schedule": schedule, "virtual_stages": virtual},
        "steps_per_print": 1000,
        "loss": {"global_aux_loss": True},  # compared with one process on the whole batch
        "activation_checkpointing": {"enabled": checkpointing},
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    topo = engine.topology
    dp, r = topo.dp_size, topo.dp_rank
    routed_mods = [m for m in engine.module.modules() if isinstance(m, RoutedExperts)]
    per_forward: list[list[int]] = []  # this rank's counts per (micro-batch, layer)

    def keep(mod, _args, _out):
        per_forward.append(mod.last_counts.tolist())

    hooks = [m.register_forward_hook(keep) for m in routed_mods]
    losses, a2a, p2p, expect, logs = [], [], [], [], []
    H = 16
    for step in range(STEPS):
        per_forward.clear()
        losses.append(engine.train_batch(iter(_micro_batches(step, dp, r))).item())
        a2a.append(engine._step_comm.get(("all_to_all", "ep"), 0))
        p2p.append(engine._step_comm.get(("pp_p2p", "pp"), 0))
        logs.append({k: engine.log.last.get(k) for k in ("tokens_per_expert_min",
                     "tokens_per_expert_max", "all_to_all_bytes")})  # fmt: skip
        if ep > 1:  # R: the rows this rank's experts got from every ep peer (test-side)
            eg = topo.group("ep")
            mine = torch.tensor(per_forward, dtype=torch.long)  # [forwards, E]
            parts = [torch.empty_like(mine) for _ in range(eg.size)]
            dist.all_gather(parts, mine, group=eg.pg)
            n_local = 8 // ep
            lo = eg.rank * n_local
            got = sum(int(p[:, lo : lo + n_local].sum()) for p in parts)
            expect.append(2 * (int(mine.sum()) + got) * H * 4)
    for h in hooks:
        h.remove()
    losses.append(engine.eval_batch(iter(_micro_batches(99, dp, r)), M).item())
    state = _whole_state(engine)
    resumed = None
    if save_dir is not None:  # saved after the 20 steps; one more step to resume against
        engine.save_checkpoint(save_dir, tag="moe")
        engine.train_batch(iter(_micro_batches(STEPS, dp, r)))
        resumed = _whole_state(engine)
    first = routed_mods[0] if routed_mods else None
    return {
        "resumed": resumed,
        "losses": losses,
        "state": state,
        "a2a": a2a,
        "p2p": p2p,
        "expect": expect,
        "logs": logs,
        "routed": first.last_counts.tolist() if first is not None else None,
        "pp_rank": topo.pp_rank,
        "dp_rank": r,
    }


def _refusals() -> list[str]:
    """MoE models a pipeline does not cut, refused by ``parallelize`` at pp 2 before it
    changes them: experts of a family meshtrain does not know, and a
    ``meshtrain.pipe.PipelineModule`` with MoE layers."""
    from torch import nn

    from meshtrain.config import load_config
    from meshtrain.distributed.topology import Topology
    from meshtrain.errors import ConfigError
    from meshtrain.models.moe import MoE, MoEConfig
    from meshtrain.parallel.compose import parallelize
    from meshtrain.pipe import PipelineModule

    unknown = _decoder()
    unknown.layers[1].mlp.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(8)])
    pipe = PipelineModule(
        [nn.Embedding(64, 16), MoE(16, 24, MoEConfig(n_experts=4)), nn.Linear(16, 64)],
        loss_fn=lambda out, labels: out.float().mean(),
    )
    messages = []
    config = load_config({"train_micro_batch_size_per_gpu": 1})
    for model in (unknown, pipe):
        try:
            parallelize(model, Topology(pp=2), config)
        except ConfigError as exc:
            messages.append(str(exc))
    return messages


def _runs(cases, with_reference: bool) -> list:
    import torch.distributed as dist

    out = [_pipeline_run(*case) for case in cases]
    if dist.get_world_size() == 2:
        out.append(_refusals())
    if with_reference and dist.get_rank() == 0:
        refs = {}
        for case in cases:
            fam = case[0]
            dp = dist.get_world_size() // 2
            if (fam, dp) not in refs:
                refs[(fam, dp)] = _reference(fam, dp)
        return [out, {f"{k[0]}/{k[1]}": v for k, v in refs.items()}]
    return [out, None]


def _check(results, cases, world: int) -> None:
    refs = results[0][1]
    dp = world // 2
    for i, case in enumerate(cases):
        fam, ep = case[0], case[1]
        ref_losses, ref_state = refs[f"{fam}/{dp}"]
        merged: dict = {}
        worst = {"loss": 0.0, "param": 0.0}
        tol = trajectory(_lr(fam), STEPS)
        for rank, (out, _) in enumerate(results):
            res = out[i]
            where = (case, rank)
            for step, (a, b) in enumerate(zip(res["losses"], ref_losses, strict=True)):
                check(f"{where} loss at step {step}", abs(a - b) / abs(b), tol)
                worst["loss"] = max(worst["loss"], abs(a - b) / abs(b))
            if ep > 1:
                assert res["a2a"] == res["expect"], (where, res["a2a"], res["expect"])
            if case[3] == 1:  # one boundary per rank: M activations (+ header) and gradients
                # the hidden states [ROWS, SEQ, 16] plus the router sums' 2 E + 6 floats
                crossing = (ROWS * SEQ * 16 + 2 * 8 + 6) * 4
                assert res["p2p"] == [M * (2 * crossing + 80)] * STEPS, (where, res["p2p"])
            for log in res["logs"]:
                if log["tokens_per_expert_min"] is None:  # transformers experts at ep 1
                    assert fam != "decoder" and ep == 1, where
                    continue
                assert 0 <= log["tokens_per_expert_min"] <= log["tokens_per_expert_max"], where
                assert (log["all_to_all_bytes"] > 0) == (ep > 1), (where, log)
            merged.update(res["state"])
        assert sorted(merged) == sorted(ref_state), case
        numel = sum(t.numel() for t in ref_state.values())
        for n, t in merged.items():
            d = float((t - ref_state[n]).norm() / ref_state[n].norm())
            check(f"{case} {n}", d, per_tensor(tol, numel, t.numel()))
            worst["param"] = max(worst["param"], d)
        norm = sum(float(t.double().pow(2).sum()) for t in merged.values()) ** 0.5
        ref_norm = sum(float(t.double().pow(2).sum()) for t in ref_state.values()) ** 0.5
        check(f"{case} parameter norm", abs(norm - ref_norm) / ref_norm, tol)
        worst["norm"] = abs(norm - ref_norm) / ref_norm
        print(f"{case[:5]}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
        start = _make(fam).state_dict()
        moved = max(float((ref_state[n] - start[n]).norm() / start[n].norm()) for n in ref_state)
        assert moved > 3e-2, case  # the 20 steps did train
        if fam == "mixtral_one_expert":  # experts 2-7 (all of ep rank 1's) get nothing
            for out, _ in results:
                assert out[i]["routed"][2:] == [0] * 6, out[i]["routed"]
        elif ep > 1:  # the replicas routed their own rows differently
            by_stage: dict = {}
            for out, _ in results:
                by_stage.setdefault(out[i]["pp_rank"], set()).add(str(out[i]["routed"]))
            assert all(len(v) == dp for v in by_stage.values()), by_stage
        # the step log covers every stage's layers: tokens per expert the same on every
        # rank, all-to-all bytes those of the rank's pipeline (its pp peers' ledgers summed)
        tokens = {
            str([(g["tokens_per_expert_min"], g["tokens_per_expert_max"]) for g in out[i]["logs"]])
            for out, _ in results
        }
        assert len(tokens) == 1, (case, tokens)
        for out, _ in results:
            if out[i]["logs"][0]["all_to_all_bytes"] is None:  # no step-log MoE numbers
                continue
            peers = [o[i] for o, _ in results if o[i]["dp_rank"] == out[i]["dp_rank"]]
            assert len(peers) == 2, case
            sums = [sum(p["a2a"][s] for p in peers) for s in range(STEPS)]
            assert [g["all_to_all_bytes"] for g in out[i]["logs"]] == sums, case


def test_moe_pipeline_pp2_matches_one_process():
    """pp 2 on 2 ranks: meshtrain's Decoder with model.moe under 1F1B, interleaved 1F1B
    (4 stages) and 1F1B with activation checkpointing, tiny Mixtral, Qwen2-MoE and
    Qwen3-MoE (4 layers) under 1F1B (ZeRO-1): 20 AdamW steps and an evaluation against one
    process (module docstring). And the MoE models a pipeline refuses, by name."""
    cases = [
        ("decoder", 1, "1f1b", 1, 0),
        ("decoder", 1, "interleaved_1f1b", 2, 1),
        ("decoder", 1, "1f1b", 1, 1, None, True),
        ("mixtral", 1, "1f1b", 1, 1),
        ("qwen2_moe", 1, "1f1b", 1, 1),
        ("qwen3_moe", 1, "1f1b", 1, 1),
    ]
    results = run_ranks(_runs, 2, cases, True)
    _check(results, cases, 2)
    for out, _ in results:
        unknown, pipe = out[-1]
        assert unknown.startswith(
            "mesh.pipeline_parallel_size: 2 with layers.1.mlp.experts (ModuleList)"
        ), unknown
        assert "PipelineModule holding MoE layers (layers.1" in pipe, pipe


def _load_one_process(save_dir: str) -> dict:
    """The pp 2 x ep 2 checkpoint loaded by one process (no pipeline, ep 1, ZeRO-0), then
    the step the 4 ranks ran after saving (M micro-batches, gradient accumulation)."""
    import torch

    import meshtrain

    torch.set_num_threads(1)
    model = _make("decoder")
    config = {
        "train_micro_batch_size_per_gpu": 2 * ROWS,
        "gradient_accumulation_steps": M,
        "optimizer": {"type": "AdamW", "params": {"lr": _lr("decoder"), "weight_decay": 0.01}},
        "steps_per_print": 1000,
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    engine.load_checkpoint(save_dir, tag="moe")
    loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for b in _micro_batches(STEPS, 2, None):
        engine.backward(engine(**b))
        engine.step()
    resumed = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"loaded": loaded, "resumed": resumed}


@pytest.mark.slow
def test_moe_pipeline_pp2_ep2_matches_one_process(tmp_path):
    """pp 2 x ep 2 on 4 ranks (ep carved out of dp 2; ZeRO-1 shards the expert weights over
    edp 1 and the rest over dp 2; ZeRO-2 reduce-scatters after every micro-batch's
    backward): the Decoder under 1F1B (ZeRO-1) and ZB-H1 (ZeRO-2), tiny Mixtral under
    1F1B (ZeRO-1), and with its routers forced to send every token to experts 0 and 1 (ep
    rank 1's experts get no token: its all-to-alls still run, with empty splits); each
    replica routes its own rows; 20 AdamW steps against one process (module docstring),
    the all-to-all bytes exact every step, the step log's tokens per expert the same on
    every rank. The Decoder's 1F1B run saves a checkpoint: it consolidates to the whole
    model exactly, one process loads exactly the saved weights, and its next step (optimizer state from the checkpoint) matches the
    4 ranks' next step within ``trajectory(lr, 1)`` normwise per tensor (fp32 summation
    order)."""
    save_dir = str(tmp_path / "ckpt")
    cases = [
        ("decoder", 2, "1f1b", 1, 1, save_dir),
        ("decoder", 2, "zb_h1", 1, 2),
        ("mixtral", 2, "1f1b", 1, 1),
        ("mixtral_one_expert", 2, "1f1b", 1, 1),
    ]
    results = run_ranks(_runs, 4, cases, True)
    _check(results, cases, 4)
    saved, resumed = {}, {}
    for out, _ in results:
        saved.update(out[0]["state"])
        resumed.update(out[0]["resumed"])
    from safetensors.torch import load_file

    from meshtrain.checkpoint import consolidate

    whole = load_file(str(consolidate(save_dir, tmp_path / "whole.safetensors", tag="moe")))
    assert sorted(whole) == sorted(saved)
    for n, t in saved.items():  # every expert at its global index, every stage's blocks
        assert torch_equal(whole[n], t), n
    one = run_ranks(_load_one_process, 1, save_dir)[0]
    assert sorted(one["loaded"]) == sorted(saved)
    for n, t in saved.items():
        assert torch_equal(one["loaded"][n], t), n
    moved = 0.0
    numel = sum(t.numel() for t in resumed.values())
    for n, t in resumed.items():
        d = float((one["resumed"][n].detach() - t).norm() / t.norm())
        check(f"resumed step {n}", d, per_tensor(trajectory(_lr("decoder"), 1), numel, t.numel()))
        moved = max(moved, float((t - saved[n]).norm() / saved[n].norm()))
    assert moved > 1e-4  # the step after loading moved the model (not a vacuous match)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
