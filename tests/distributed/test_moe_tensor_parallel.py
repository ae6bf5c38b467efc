"""Tensor parallelism of attention composed with expert parallelism: ep 2 x tp 2 (world 4,
dp 2), ``parallel.tensor.moe_blocks``.

Attention, embeddings and the LM head are tensor-parallel over tp; every MoE block (router,
experts, shared experts) stays whole and runs replicated on the full hidden state, its
experts sharded over the ep group of its tp index. The two ranks of a tp group hold the
same rows, the two dp replicas different rows, so the ep groups route differently.


* **One step, every tensor** (tiny Mixtral, Qwen2-MoE, Qwen3-MoE and the Decoder with
  ``model.moe``, built with ``apply_tensor_parallel`` + ``apply_expert_parallel``): the
  mean loss (auxiliary loss included) and every parameter's gradient, reduced as the
  engine does (non-expert over dp, expert over edp, both / dp; tp shards gathered) within
  ``gradient()`` (each tensor, and the whole gradient normwise; the loss within
  ``evaluation()``; ``tests/tolerance.py``) of one process on all rows
  (the transformers models with an attention mask that pads the tail of each replica's
  first row, which the auxiliary loss leaves out).
  Per tensor: the attention gradients of these tiny models are small results of
  cancelling sums (Qwen2-MoE's query bias: 1.5e-5 for a whole gradient of 0.17), so the
  summation order moves them most; in one process, without tp or ep and without the
  auxiliary loss, only splitting the same 4 rows into 2 + 2 already moves the query bias
  by 7.2e-7 and the key bias by 7.6e-7 (measured). A gradient summed over tp that should
  not be, or divided wrongly, would be off by 0.5 or more. The router's gradient is
  equal on the two tp ranks (it must not be summed over tp); the ep all-to-all bytes
  equal ``2 (N k + R) H 4`` per layer exactly, and no all-to-all runs on another group.
* **20 AdamW steps through the engine** (ZeRO-1 over dp, the experts' edp of one rank;
  ZeRO-3 for Mixtral with and Qwen2-MoE without sequence parallelism),
  Mixtral and Qwen2-MoE with clipping by the global norm active, the Decoder without: the
  per-step loss, the global gradient norm (Mixtral, Qwen2-MoE) and the whole model and its
  norm after 20 steps within ``trajectory(lr, 20)`` of one process with
  ``clip_grad_norm_`` (the gradient norms within ``composed(trajectory, 2)``): fp32 sums
  in another order (tp's partial sums, the all-reduces over dp, the experts' rows from two
  replicas), carried by Adam's normalised update.
* **Checkpoint**: the Qwen2-MoE engine's checkpoint (tp-sharded attention and ep-sharded
  experts) loads at one process (tp 1, ep 1) to exactly the trained weights, and
  ``consolidate`` gives a folder ``from_pretrained`` loads to the same weights.

Every check runs twice: without sequence parallelism (the tp peers route the same tokens
identically) and with it (``tensor_parallel.sequence_parallel``: each tp rank's MoE
blocks route its own sequence shard, their gradients summed over tp; the peers route
differently and send fewer rows; the step log's tokens per expert are the same global
counts as without it).
"""

from __future__ import annotations

import torch

from tests.distributed.test_moe import rel, tiny_causal_lm, tiny_decoder
from tests.distributed.training import max_rel_diff
from tests.harness import run_ranks
from tests.tolerance import check, composed, evaluation, gradient, trajectory

STEPS, ROWS, CLIP = 20, 2, 0.085
MESH = {"tensor_parallel_size": 2, "expert_parallel_size": 2}


def _make(fam: str):
    if fam == "decoder":
        return tiny_decoder()
    return tiny_causal_lm(fam)


def _loss(out):
    return out if hasattr(out, "backward") else out.loss


def _ids(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(700 + step))


def _experts_modules(model):
    from meshtrain.parallel.experts.routed import RoutedExperts

    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def _router_weight(model):
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
    return (layer.router if hasattr(layer, "router") else layer.gate).weight


# ------------------------------------------------------------------ one step, every tensor


def _step_checks(topo, fam: str, sp: bool) -> dict:
    import torch.distributed as dist

    from meshtrain.distributed import comm
    from meshtrain.estimate.experts import dense_on_one_tp_rank, expert_counts, split_expert_params
    from meshtrain.parallel.experts import is_expert_param
    from meshtrain.parallel.experts.aux_loss import reduce_aux_loss_over
    from meshtrain.parallel.experts.shard import apply_expert_parallel
    from meshtrain.parallel.tensor.apply import apply_tensor_parallel
    from meshtrain.parallel.tensor.moe_blocks import sum_moe_grads_over
    from meshtrain.parallel.tensor.sharding import specs_by_param, unshard_tensor

    replicas, tp, ep, edp = (topo.replica_group, topo.tp_group, topo.ep_group, topo.group("edp"))
    dp, d = replicas.size, replicas.rank
    ids = _ids(0, ROWS * dp)
    ref = _make(fam)
    kw = {}
    if fam != "decoder":  # padding: the auxiliary loss leaves masked tokens out
        mask = torch.ones_like(ids)
        mask[::ROWS, -3:] = 0  # the tail of each replica's first row: sequence shard 1
        labels = ids.masked_fill(mask == 0, -100)
        kw = {"attention_mask": mask}
    else:
        labels = ids
    ref_loss = _loss(ref(input_ids=ids, labels=labels, **kw))
    ref_loss.backward()
    refs = dict(ref.named_parameters())
    whole = sum(float(p.grad.double().pow(2).sum()) for p in refs.values()) ** 0.5

    model = _make(fam)
    # what ``meshtrain estimate`` predicts one rank holds (MoE blocks whole over tp)
    (dense, _), (expert, _) = split_expert_params(model)
    local = dense_on_one_tp_rank(model, tp.size)[0]
    predicted = expert_counts(dense, expert, ep=ep.size, dp=dp, tp=tp.size, dense_tp_local=local)
    apply_tensor_parallel(model, topo, sequence_parallel=sp)
    apply_expert_parallel(model, topo)
    held = sum({id(p): p.numel() for p in model.parameters()}.values())
    assert sum_moe_grads_over(model, tp) if sp else True  # as ``parallelize`` does
    assert reduce_aux_loss_over(model, replicas, tp if sp else None)
    specs = specs_by_param(model)
    mine = ids[ROWS * d : ROWS * (d + 1)]
    before = topo.stats.snapshot()
    rows = slice(ROWS * d, ROWS * (d + 1))
    kw = {k: v[rows] for k, v in kw.items()}
    loss = _loss(model(input_ids=mine, labels=labels[rows], **kw))
    loss.backward()
    moved = topo.stats.diff(topo.stats.snapshot(), before)

    # the all-to-all bytes: per layer N k rows out and R rows back, forward and backward
    hidden, expect = model.config.hidden_size if fam != "decoder" else model.config.dim, 0
    for experts in _experts_modules(model):
        counts = experts.last_counts
        everyone = [torch.empty_like(counts) for _ in range(ep.size)]
        dist.all_gather(everyone, counts, group=ep.pg)  # raw: not in the ledger read above
        n_local = experts.num_local_experts
        lo = ep.rank * n_local
        received = sum(int(c[lo : lo + n_local].sum()) for c in everyone)
        expect += 2 * (int(counts.sum()) + received) * hidden * 4
    a2a = {g: n for (op, g), n in moved.items() if op == "all_to_all"}

    worst, sharded, num = {}, 0, 0.0
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        if is_expert_param(p):
            comm.all_reduce(g, edp, label="state_dict")
            lo = ep.rank * p.shape[0]
            want = refs[n].grad[lo : lo + p.shape[0]]
        else:
            comm.all_reduce(g, replicas, label="state_dict")
            want = refs[n].grad
        if id(p) in specs:
            g, sharded = unshard_tensor(g, specs[id(p)], tp), sharded + 1
        worst[n] = rel(g / dp, want)
        num += float((g / dp - want).double().pow(2).sum())
    router = _router_weight(model).grad.detach().clone()
    peer = router.clone()
    comm.broadcast(peer, 0, tp, label="state_dict")  # tp rank 0's
    stats = loss.detach().reshape(1).clone()
    comm.all_reduce(stats, replicas, label="state_dict")
    return {
        "loss": abs(stats.item() / dp - ref_loss.item()) / ref_loss.item(),
        "grads": max(worst.values()),
        "whole": num**0.5 / whole,
        "worst": max(worst, key=worst.get),
        "tp_sharded": sharded,
        "router_same_over_tp": bool(torch.equal(router, peer)),
        "a2a": a2a,
        "expect_a2a": expect,
        "routed": _experts_modules(model)[0].last_counts.tolist(),
        "held": (held, predicted.per_rank),
    }


# ------------------------------------------------------------------ 20 steps, the engine


def _config(fam: str, world_rows: int = ROWS, mesh=MESH, sp: bool = False, stage: int = 1) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": world_rows,
        "tensor_parallel": {"sequence_parallel": sp},
        "optimizer": {"type": "AdamW", "params": {"lr": _lr(fam), "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": mesh,
        "steps_per_print": 1000,
        "loss": {"global_aux_loss": True},  # compared with one process on the whole batch
    }
    if fam != "decoder":
        config["gradient_clipping"] = CLIP
    return config


def _lr(fam: str) -> float:
    # the Decoder at 1e-3: tests/distributed/test_moe.py ``_lr`` says why
    return 1e-3 if fam == "decoder" else 1e-2


def _whole_state(engine) -> dict:
    """The one-process state dict: tp shards gathered (``module_state_dict``), expert
    slices all-gathered over ep."""
    import torch.distributed as dist

    from meshtrain.parallel.experts import is_expert_param

    experts = {n for n, p in engine.module.named_parameters() if is_expert_param(p)}
    ep = engine.topology.ep_group
    state = {}
    for name, t in engine.module_state_dict().items():
        if name in experts:
            parts = [torch.empty_like(t) for _ in range(ep.size)]
            dist.all_gather(parts, t.contiguous(), group=ep.pg)
            t = torch.cat(parts)
        state[name] = t.detach().clone()
    return state


def _train(fam: str, sp: bool, stage: int, save_dir: str | None) -> dict:
    import torch.distributed as dist

    import meshtrain

    model = _make(fam)
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=_config(fam, sp=sp, stage=stage)
    )
    topo = engine.topology
    assert engine.zero.experts is not None and topo.tp_size == 2 and topo.ep_size == 2
    dp, d = topo.replica_group.size, topo.replica_group.rank
    losses, norms = [], []
    for step in range(STEPS):
        ids = _ids(step, ROWS * dp)[ROWS * d : ROWS * (d + 1)]
        loss = _loss(engine(input_ids=ids, labels=ids))
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / topo.world_size)  # both tp ranks hold their replica's loss
        norms.append(engine.get_global_grad_norm())
    out = {"losses": losses, "norms": norms, "state": _whole_state(engine)}
    out["stage"], out["sp"] = engine.zero_stage, engine.module.meshtrain_tp["sequence_parallel"]
    keys = ("tokens_per_expert_min", "tokens_per_expert_max", "all_to_all_bytes")
    out["log"] = {k: engine.log.last.get(k) for k in keys}
    if save_dir is not None:
        from meshtrain.checkpoint import consolidate

        engine.save_checkpoint(save_dir)
        dist.barrier()
        if dist.get_rank() == 0:
            consolidate(save_dir, save_dir + "-hf")
        dist.barrier()
    return out


def _all_checks(save_dir: str) -> dict:
    import meshtrain
    from meshtrain.distributed.topology import Topology

    meshtrain.init_distributed()
    topo = Topology(tp=2, ep=2)
    out = {"step": {(f, sp): _step_checks(topo, f, sp) for f in FAMILIES_STEP for sp in SP}}
    out["train"] = {
        (f, sp, z): _train(f, sp, z, save_dir if (f, sp, z) == ("qwen2_moe", False, 1) else None)
        for f, sp, z in TRAIN
    }
    out["coords"] = (topo.tp_rank, topo.dp_rank, topo.ep_rank, topo.group("edp").size)
    return out


FAMILIES = ("mixtral", "qwen2_moe", "decoder")
FAMILIES_STEP = ("mixtral", "qwen2_moe", "qwen3_moe", "decoder")
SP = (False, True)
# (family, sequence parallelism, ZeRO stage): every family both ways at ZeRO-1, and ZeRO-3
# (every weight sharded over dp, the experts over edp, gathered per block) once each way
TRAIN = [(f, sp, 1) for f in FAMILIES for sp in SP] + [
    ("mixtral", True, 3),
    ("qwen2_moe", False, 3),
]


def _reference(fam: str, rows: int):
    model = _make(fam)
    opt = torch.optim.AdamW(model.parameters(), lr=_lr(fam), weight_decay=0.01)
    losses, norms = [], []
    for step in range(STEPS):
        ids = _ids(step, rows)
        loss = _loss(model(input_ids=ids, labels=ids))
        loss.backward()
        if fam != "decoder":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load_at_one_process(save_dir: str) -> dict:
    import meshtrain

    model = _make("qwen2_moe")
    mesh = {"tensor_parallel_size": 1, "expert_parallel_size": 1}
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=_config("qwen2_moe", mesh=mesh)
    )
    engine.load_checkpoint(save_dir)
    return {k: v.detach().clone() for k, v in engine.module_state_dict().items()}


def _norm(state: dict) -> float:
    return sum(float(v.double().pow(2).sum()) for v in state.values()) ** 0.5


def test_ep2_tp2_step_training_and_checkpoint(tmp_path):
    """ep 2 x tp 2 on 4 ranks, without and with sequence parallelism (module docstring):
    one step's every gradient and the all-to-all bytes, 20 AdamW steps against one
    process, the checkpoint at one process."""
    save_dir = str(tmp_path / "ckpt")
    results = run_ranks(_all_checks, 4, save_dir, timeout=900)
    coords = [res["coords"] for res in results]
    # tp peers (0,1) and (2,3) share a dp replica and an ep index: the same experts
    assert coords == [(0, 0, 0, 1), (1, 0, 0, 1), (0, 1, 1, 1), (1, 1, 1, 1)], coords
    for rank, res in enumerate(results):
        for key, c in res["step"].items():
            where = (rank, key)
            check(f"{where} loss", c["loss"], evaluation())
            check(f"{where} gradient of {c['worst']}", c["grads"], gradient())
            check(f"{where} whole gradient", c["whole"], gradient())
            assert c["tp_sharded"] >= 8, (where, c["tp_sharded"])  # attention, embed, head
            assert c["router_same_over_tp"], where
            assert c["a2a"] == {"ep": c["expect_a2a"]} and c["expect_a2a"] > 0, (where, c)
            held, estimated = c["held"]
            assert held == estimated, (where, "parameters held vs estimate", held, estimated)
    for fam in FAMILIES_STEP:
        routes = [str(res["step"][fam, False]["routed"]) for res in results]
        assert routes[0] == routes[1] and routes[2] == routes[3], (fam, routes)  # tp peers
        assert routes[0] != routes[2], (fam, routes)  # the replicas route differently
        # sequence parallelism: each tp rank routes its own shard
        routes = [str(res["step"][fam, True]["routed"]) for res in results]
        assert routes[0] != routes[1] and routes[2] != routes[3], (fam, routes)
        # ... and sends about half the rows of the run without it
        for res in results:
            half, whole = (res["step"][fam, sp]["expect_a2a"] for sp in SP[::-1])
            assert half < whole, (fam, half, whole)

    for fam in FAMILIES:
        ref_losses, ref_norms, ref_state = _reference(fam, ROWS * 2)
        cases = [(sp, z) for f, sp, z in TRAIN if f == fam]
        if ref_norms:
            assert max(ref_norms) > CLIP, "clipping must be active for the test to mean anything"
        tol = trajectory(_lr(fam), STEPS)
        for rank, res in enumerate(results):
            for sp, z in cases:
                c, where = res["train"][fam, sp, z], (fam, sp, z, rank)
                assert (c["sp"], c["stage"]) == (sp, z), where
                loss = max(abs(a - b) / b for a, b in zip(c["losses"], ref_losses, strict=True))
                check(f"{where} loss", loss, tol)
                if ref_norms:
                    norm = max(abs(a - b) / b for a, b in zip(c["norms"], ref_norms, strict=True))
                    check(f"{where} grad norm", norm, composed(tol, 2))
                check(f"{where} model", max_rel_diff(c["state"], ref_state), tol)
                norm_diff = abs(_norm(c["state"]) - _norm(ref_state)) / _norm(ref_state)
                check(f"{where} model norm", norm_diff, tol)
                assert c["log"]["all_to_all_bytes"] > 0, where
            # the last step's tokens per expert are the global batch's either way (summed
            # over the replicas, and over tp under sequence parallelism)
            logs = [res["train"][fam, sp, z]["log"] for sp, z in cases]
            for key in ("tokens_per_expert_min", "tokens_per_expert_max"):
                assert len({log[key] for log in logs}) == 1, (key, logs)
        assert max_rel_diff(ref_state, _make(fam).state_dict()) > 3e-2, fam  # it trained

    saved = results[0]["train"]["qwen2_moe", False, 1]["state"]
    loaded = run_ranks(_load_at_one_process, 1, save_dir)[0]
    assert loaded.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(save_dir + "-hf").state_dict()
    for k, v in saved.items():
        assert torch.equal(exported[k], v), k
