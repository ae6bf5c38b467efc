"""Context parallelism (``mesh.context_parallel_size``, ring attention) against one process,
on real gloo processes.

Tolerances (``tests/tolerance.py``): fp32 throughout; cp changes only the order of
additions (the online-softmax merge of key blocks instead of one softmax, the loss summed
per rank then over ranks). After 20 AdamW steps at lr 1e-3 the per-step losses, the
whole-model parameter norm and the normwise distance of all parameters are held to
``trajectory(1e-3, 20)`` (observed ~2e-7, ~1e-9 and ~3e-6). Per-tensor gradients of one
step from identical weights: ``gradient()`` normwise per tensor (observed ~1e-6; a
tensor's gradient is a sum over tokens that cp regroups). Ring attention alone (output
and q/k/v gradients, one evaluation): ``gradient()``. bf16 against fp32:
``against_fp32("bfloat16")``. A checkpoint's loss from the same weights, evaluated at
another layout: ``evaluation()``.

Checked, per spawn:

* ring attention alone, at cp 2 (world 4 as dp 2 x cp 2) and cp 4, grouped-query heads,
  with and without document ids: output and q/k/v gradients equal ``causal_attention``
  on the whole sequence; bytes on the ledger exactly ``(C-1) x (|k| + |v| [+ |ids|])``
  sent and received forward and ``(C-1) x (|k| + |v| + |dk| + |dv|)`` backward (the
  blocks go around the ring again instead of being kept);
* cp 2 through ``meshtrain.initialize``: the Decoder, tiny Llama (GQA) and GPT-2, on rows
  with a -100 prompt and a packed row (three documents): 20 AdamW steps with each method
  (``context_parallel.method`` ring and all_to_all), per-tensor gradients, ring bytes per
  layer of a whole model, a length 2C does not divide (padded), a checkpoint saved at
  cp 2 loaded at cp 1, one step's per-tensor gradients of tiny Qwen2 and Mistral, a cp
  mesh started from the config alone, 5 bf16 steps (against fp32), and the refusals (left padding, a model without cp
  attention, chunked loss);
* 4 ranks: cp 4 (Decoder, Llama; both methods); cp 2 x dp 2 with ZeRO-3 (Llama), ZeRO-2
  (Decoder) and ZeRO-1 with activation checkpointing (Decoder); cp 2 x tp 2 with sequence
  parallelism (Decoder, Llama, GPT-2) and without (Decoder); cp 2 x pp 2 (Decoder, Llama,
  GPT-2 with its LM head tied across stages: 20 steps of two micro-batches through the
  1F1B schedule); a ZeRO-3 checkpoint saved at cp 2 x dp 2 loaded at cp 4.
"""

from __future__ import annotations

from tests.distributed.cp_models import LR
from tests.harness import run_ranks
from tests.tolerance import against_fp32, check, evaluation, gradient, trajectory

STEPS = 20
TOL = trajectory(LR, STEPS)


def _ring_function() -> dict:
    import torch

    from meshtrain.distributed.topology import Topology
    from meshtrain.models.attention import causal_attention
    from meshtrain.parallel.context import layout
    from meshtrain.parallel.context.ring import ring_attention

    out = {}
    for cp in (2, 4):
        topo = Topology(cp=cp)
        g = topo.cp_group
        gen = torch.Generator().manual_seed(0)
        length = 16
        q, go = (torch.randn(2, 4, length, 6, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 2, length, 6, generator=gen) for _ in range(2))
        docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
        for d in (None, docs):
            whole = [x.clone().requires_grad_() for x in (q, k, v)]
            ref = causal_attention(*whole, document_ids=d)
            ref_grads = torch.autograd.grad(ref, whole, go)

            def mine(x, dim=2, rank=g.rank, cp=cp):
                return layout.shard(x, rank, cp, dim).contiguous()

            local = [mine(x).requires_grad_() for x in (q, k, v)]
            before = topo.stats.snapshot()
            o = ring_attention(*local, g, document_ids=None if d is None else mine(d, 1))
            mid = topo.stats.snapshot()
            grads = torch.autograd.grad(o, local, mine(go))
            after = topo.stats.snapshot()
            kv = 2 * local[1].numel() * 4
            ids = 0 if d is None else mine(d, 1).numel() * 8
            errs = [float((o - mine(ref)).abs().max())]
            errs += [
                float((a - mine(b)).abs().max()) for a, b in zip(grads, ref_grads, strict=True)
            ]
            out[cp, d is not None] = {
                "errs": errs,
                "forward": topo.stats.diff(mid, before),
                "backward": topo.stats.diff(after, mid),
                "expected_forward": (cp - 1) * (kv + ids),
                # the blocks go around again, and their fp32 gradients once
                "expected_backward": (cp - 1) * (kv + kv),
            }
    return out


def test_ring_attention_matches_whole_sequence_and_moves_exact_bytes():
    for res in run_ranks(_ring_function, 4):
        for (cp, docs), r in res.items():
            check(f"ring attention cp {cp} docs {docs}", max(r["errs"]), gradient())
            want_f = {("send", "cp"): r["expected_forward"], ("recv", "cp"): r["expected_forward"]}
            assert r["forward"] == want_f, (cp, docs, r["forward"])
            want_b = {
                ("send", "cp"): r["expected_backward"],
                ("recv", "cp"): r["expected_backward"],
            }
            assert r["backward"] == want_b, (cp, docs, r["backward"])


def _grads_per_tensor(kind: str, topo) -> float:
    """One step's gradients of each tensor at cp vs one process: worst normwise error."""
    from meshtrain.config import load_config
    from meshtrain.distributed import comm
    from meshtrain.parallel.context.apply import apply_context_parallel
    from tests.distributed.cp_models import ROWS, batch, build, loss_of

    inputs = batch(0, ROWS)
    ref = build(kind)
    loss_of(ref, kind, inputs).backward()
    model = build(kind)
    apply_context_parallel(model, topo, load_config({"mesh": {}}))
    loss_of(model, kind, inputs).backward()
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        comm.all_reduce(grad, topo.cp_group)
        grad /= topo.cp_size  # the reducer's average over dp x cp
        want = ref_params[name].grad
        worst = max(worst, float((grad - want).norm() / want.norm().clamp(min=1e-30)))
    return worst


def _model_ring_bytes(topo) -> dict:
    """One forward and backward of the Decoder: the cp group's bytes against the ring's
    formula for its 2 layers (k, v and the packed row's document ids)."""
    import meshtrain
    from tests.distributed.cp_models import ROWS, SEQ, batch, build, loss_of

    model = build("decoder")
    engine, *_ = meshtrain.initialize(
        model=model,
        config={"train_micro_batch_size_per_gpu": ROWS, "optimizer": {"type": "SGD"}},
        topology=topo,
    )
    cfg, c = model.config, topo.cp_size
    local = SEQ // c
    kv = 2 * ROWS * cfg.n_heads * local * (cfg.dim // cfg.n_heads) * 4
    ids = ROWS * local * 8
    stats = topo.stats
    before = stats.snapshot()
    loss = loss_of(engine, "decoder", batch(0, ROWS))
    mid = stats.snapshot()
    engine.backward(loss)
    after = stats.snapshot()
    pick = lambda d: {k: v for k, v in d.items() if k[1] == "cp"}  # noqa: E731
    return {
        "forward": pick(stats.diff(mid, before)),
        "backward": pick(stats.diff(after, mid)),
        "want_forward": cfg.n_layers * (c - 1) * (kv + ids),
        "want_backward": cfg.n_layers * (c - 1) * (kv + kv),  # the blocks again, fp32 grads
    }


def _checkpoint_across_cp(cp_topo, path: str) -> dict:
    """Train 3 steps at cp 2, save; load into a cp 1 layout (dp 2 on the same ranks): the
    same weights, and the loss of the next batch equals one process's."""
    import torch
    import torch.distributed as dist

    import meshtrain
    from meshtrain.distributed.topology import Topology
    from tests.distributed.cp_models import ROWS, batch, build, engine_run, loss_of

    _, engine, state = engine_run("decoder", 3, {"mesh": {"context_parallel_size": 2}}, cp_topo)
    engine.save_checkpoint(path, tag="cp2")
    dist.barrier()
    flat = Topology(dp=2)
    model = build("decoder")
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    loaded, *_ = meshtrain.initialize(model=model, config=cfg, topology=flat)
    loaded.load_checkpoint(path, tag="cp2")
    again = loaded.module_state_dict()
    same = all(torch.equal(again[k], state[k]) for k in state)
    ref = build("decoder")
    ref.load_state_dict(state)
    inputs = batch(7, ROWS)
    with torch.no_grad():
        return {
            "same": same and again.keys() == state.keys(),
            "loss": float(loss_of(loaded, "decoder", inputs)),
            "cp_loss": float(loss_of(engine, "decoder", inputs)),
            "ref_loss": float(loss_of(ref, "decoder", inputs)),
        }


def _refusals(topo) -> list[str]:
    import torch

    import meshtrain
    from meshtrain.errors import ConfigError
    from tests.distributed.cp_models import ROWS, batch, build
    from tests.trainer.common import BasicNet

    seen = []
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "optimizer": {"type": "SGD"}}
    # the config alone builds the cp mesh (no topology given)
    started, *_ = meshtrain.initialize(
        model=build("decoder"), config={**cfg, "mesh": {"context_parallel_size": 2}}
    )
    seen.append(f"cp={started.topology.cp_size} dp={started.topology.dp_size}")
    engine, *_ = meshtrain.initialize(model=build("llama"), config=cfg, topology=topo)
    inputs = batch(0, ROWS)
    mask = torch.ones_like(inputs["input_ids"])
    mask[:, 0] = 0  # left padding
    for attempt in (
        lambda: engine(**inputs, attention_mask=mask),
        lambda: meshtrain.initialize(model=BasicNet(), config=cfg, topology=topo),
        lambda: meshtrain.initialize(
            model=build("decoder"), config={**cfg, "loss": {"chunked": True}}, topology=topo
        ),
    ):
        try:
            attempt()
            seen.append("accepted")
        except ConfigError as exc:
            seen.append(str(exc))
    return seen


def _cp2(path: str) -> dict:
    from meshtrain.distributed.topology import Topology
    from tests.distributed.cp_models import KINDS, engine_run, max_rel, norm_rel, reference
    from tests.distributed.training import max_rel_diff

    topo = Topology(cp=2)
    out: dict = {}
    for kind in KINDS:
        ref_losses, ref_state = reference(kind, STEPS, 1)
        losses, _, state = engine_run(kind, STEPS, {"mesh": {"context_parallel_size": 2}}, topo)
        out[kind] = {
            "loss": max_rel(losses, ref_losses),
            "norm": norm_rel(state, ref_state),
            "params": max_rel_diff(state, ref_state),
            "grads": _grads_per_tensor(kind, topo),
        }
    a2a = {"mesh": {"context_parallel_size": 2}, "context_parallel": {"method": "all_to_all"}}
    for kind in KINDS:  # the same training with the all-to-all (Ulysses) method
        ref_losses, ref_state = reference(kind, STEPS, 1)
        losses, _, state = engine_run(kind, STEPS, a2a, topo)
        out[kind, "all_to_all"] = {
            "loss": max_rel(losses, ref_losses),
            "norm": norm_rel(state, ref_state),
        }
    for kind in ("qwen2", "mistral"):  # the other transformers families: one step's gradients
        out[kind] = {"grads": _grads_per_tensor(kind, topo)}
    # 14 tokens: not divisible by 2C = 4, padded to 16 with -100 labels
    ref_losses, ref_state = reference("decoder", 3, 1, seq=14)
    losses, _, state = engine_run("decoder", 3, {"mesh": {"context_parallel_size": 2}}, topo, 14)
    out["padded"] = {
        "loss": max_rel(losses, ref_losses),
        "norm": norm_rel(state, ref_state),
    }
    # bf16 (fp32 masters): the ring computes in fp32 and returns bf16
    ref_losses, _ = reference("decoder", 5, 1)
    bf16 = {"mesh": {"context_parallel_size": 2}, "bf16": {"enabled": True}}
    losses, _, _ = engine_run("decoder", 5, bf16, topo)
    out["bf16"] = max_rel(losses, ref_losses)
    out["bytes"] = _model_ring_bytes(topo)
    out["checkpoint"] = _checkpoint_across_cp(topo, path)
    out["refused"] = _refusals(topo)
    return out


def test_cp2_parity_bytes_checkpoint_and_refusals(tmp_path):
    for res in run_ranks(_cp2, 2, str(tmp_path / "ckpt")):
        for kind in ("decoder", "llama", "gpt2", "padded"):
            r = res[kind]
            padded = trajectory(LR, 3)  # the padded run trains 3 steps
            check(f"{kind} loss", r["loss"], padded if kind == "padded" else TOL)
            check(f"{kind} norm", r["norm"], padded if kind == "padded" else TOL)
            if kind != "padded":
                check(f"{kind} params", r["params"], TOL)
                check(f"{kind} grads", r["grads"], gradient())
        for kind in ("qwen2", "mistral"):
            check(f"{kind} grads", res[kind]["grads"], gradient())
        for kind in ("decoder", "llama", "gpt2"):
            r = res[kind, "all_to_all"]
            check(f"{kind} all_to_all loss", r["loss"], TOL)
            check(f"{kind} all_to_all norm", r["norm"], TOL)
        check("bf16 losses", res["bf16"], against_fp32("bfloat16"))
        b = res["bytes"]
        want = {("send", "cp"): b["want_forward"], ("recv", "cp"): b["want_forward"]}
        # the forward also all-reduces the loss's value over cp (a scalar, "control")
        assert {k: v for k, v in b["forward"].items() if k[0] != "control"} == want, b
        assert b["forward"][("control", "cp")] == 2 * 4, b
        want = {("send", "cp"): b["want_backward"], ("recv", "cp"): b["want_backward"]}
        assert b["backward"] == want, b
        ck = res["checkpoint"]
        assert ck["same"], ck
        ref = abs(ck["ref_loss"])
        check("loss loaded at cp 1", abs(ck["loss"] - ck["ref_loss"]) / ref, evaluation())
        check("loss at cp 2", abs(ck["cp_loss"] - ck["ref_loss"]) / ref, evaluation())
        started, left, other, chunked = res["refused"]
        assert started == "cp=2 dp=1", started
        assert left.startswith("context parallelism: attention_mask has left"), left
        assert "BasicNet" in other and "has no context-parallel attention" in other, other
        assert chunked.startswith("loss.chunked with mesh.context_parallel_size 2"), chunked


def _four(path: str) -> dict:
    import torch
    import torch.distributed as dist

    import meshtrain
    from meshtrain.distributed.topology import Topology
    from tests.distributed.cp_models import (
        KINDS,
        LR,
        ROWS,
        batch,
        build,
        engine_run,
        max_rel,
        norm_rel,
        reference,
    )

    out: dict = {}
    cp4, cp2_dp2 = Topology(cp=4), Topology(cp=2, dp=2)
    a2a = {"mesh": {"context_parallel_size": 4}, "context_parallel": {"method": "all_to_all"}}
    cp2 = {"mesh": {"context_parallel_size": 2}}
    tp = {"mesh": {"context_parallel_size": 2, "tensor_parallel_size": 2}}
    layouts = [
        ("cp4", cp4, {"mesh": {"context_parallel_size": 4}}, ("decoder", "llama"), 1),
        ("cp4_all_to_all", cp4, a2a, ("decoder", "llama"), 1),
        ("cp2_dp2_zero3", cp2_dp2, {**cp2, "zero_optimization": {"stage": 3}}, ("llama",), 2),
        ("cp2_dp2_zero2", cp2_dp2, {**cp2, "zero_optimization": {"stage": 2}}, ("decoder",), 2),
        (
            "cp2_dp2_zero1_checkpointing",
            cp2_dp2,
            {
                **cp2,
                "zero_optimization": {"stage": 1},
                "activation_checkpointing": {"enabled": True},
            },
            ("decoder",),
            2,
        ),
        (
            "cp2_tp2_sp",
            Topology(cp=2, tp=2),
            {**tp, "tensor_parallel": {"sequence_parallel": True}},
            ("decoder", "llama", "gpt2"),
            1,
        ),
        ("cp2_tp2", Topology(cp=2, tp=2), tp, ("decoder",), 1),
    ]
    for name, topo, config, kinds, dp in layouts:
        for kind in kinds:
            ref_losses, ref_state = reference(kind, STEPS, dp)
            losses, _, state = engine_run(kind, STEPS, config, topo)
            out[name, kind] = {
                "loss": max_rel(losses, ref_losses),
                "norm": norm_rel(state, ref_state),
            }
    # saved at cp 2 x dp 2 under ZeRO-3 (sharded over the 4 replicas), loaded at cp 4
    _, engine, state = engine_run("decoder", 3, {**cp2, "zero_optimization": {"stage": 3}}, cp2_dp2)
    engine.save_checkpoint(path, tag="cp2dp2")
    dist.barrier()
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "optimizer": {"type": "AdamW"}}
    loaded, *_ = meshtrain.initialize(
        model=build("decoder"), config={**cfg, "mesh": {"context_parallel_size": 4}}, topology=cp4
    )
    loaded.load_checkpoint(path, tag="cp2dp2")
    again = loaded.module_state_dict()
    out["checkpoint_cp4"] = again.keys() == state.keys() and all(
        torch.equal(again[k], state[k]) for k in state
    )
    # cp 2 x pp 2: 20 steps of 2 micro-batches of one row through the 1F1B schedule
    pp = Topology(cp=2, pp=2)
    cfg_pp = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "mesh": {"context_parallel_size": 2, "pipeline_parallel_size": 2},
    }
    for kind in KINDS:
        engine, *_ = meshtrain.initialize(model=build(kind), config=cfg_pp, topology=pp)
        losses = []
        for step in range(STEPS):
            rows = batch(step, ROWS)
            micro = [{k: v[i : i + 1] for k, v in rows.items()} for i in range(ROWS)]
            losses.append(float(engine.train_batch(iter(micro))))
        ref_losses, ref_state = reference(kind, STEPS, 1)
        state = engine.module_state_dict()  # the whole model, gathered over the stages
        out["cp2_pp2", kind] = {
            "loss": max_rel(losses, ref_losses),
            "norm": norm_rel(state, ref_state),
            "keys": state.keys() == ref_state.keys(),
        }
    return out


def test_cp4_and_cp_with_zero_tp_sp_pp_and_checkpoint_at_cp4(tmp_path):
    for res in run_ranks(_four, 4, str(tmp_path / "ckpt"), timeout=600):
        assert res.pop("checkpoint_cp4") is True
        for key, r in res.items():
            check(f"{key} loss", r["loss"], TOL)
            check(f"{key} norm", r["norm"], TOL)
            assert r.get("keys", True), (key, r)
