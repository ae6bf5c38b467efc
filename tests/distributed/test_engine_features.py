"""Engine behaviour on 2 real ranks: communication accounting, mixed precision, loss
scaling, accumulation without communication, client optimizer/scheduler, checkpointing.

bf16 tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 3.9e-3) in
weights, activations and gradients; over 20 steps of a tiny decoder the loss tracks the
fp32 run within ``against_fp32("bfloat16")`` relative (``tests/tolerance.py``; measured:
8.7e-5 at 2 ranks). Activation checkpointing recomputes the same forward in the same order:
the same losses exactly.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed.training import TINY_DECODER, engine_run
from tests.harness import run_ranks
from tests.tolerance import against_fp32, check


def _accounting():
    """Bytes per step against theory, and silence off the boundary."""
    import torch.distributed as dist

    from meshtrain.models import Decoder, count_parameters

    n = count_parameters(Decoder(TINY_DECODER))
    world = dist.get_world_size()
    out = {"n": n, "world": world}
    _, _, step_bytes, off = engine_run("decoder", 3, micro=2, accum=4)
    out["stage0"] = (step_bytes, off)
    frozen = ("embed.weight", "layers.0.attn.q_proj.weight")
    _, _, step_bytes, off = engine_run("decoder", 2, micro=2, accum=1, frozen=frozen)
    out["frozen"] = step_bytes
    _, _, step_bytes, off = engine_run(
        "decoder", 2, micro=2, accum=2, config_extra={"zero_optimization": {"stage": 1}}
    )
    out["stage1"] = (step_bytes, off)
    return out


def test_comm_bytes_match_theory():
    out = run_ranks(_accounting, 2)[0]
    n, world = out["n"], out["world"]
    step_bytes, off = out["stage0"]
    # all-reduce of every fp32 gradient once per step: 2 x 4 bytes x n (comm convention)
    assert step_bytes == [{"all_reduce": 8 * n, "total": 8 * n}] * 3
    assert off == [0] * 9  # 3 of every 4 micro-steps communicate nothing
    frozen_numel = TINY_DECODER.vocab_size * TINY_DECODER.dim + TINY_DECODER.dim**2
    assert (
        out["frozen"]
        == [{"all_reduce": 8 * (n - frozen_numel), "total": 8 * (n - frozen_numel)}] * 2
    )
    step_bytes, off = out["stage1"]
    for b in step_bytes:
        # ZeRO-1: reduce-scatter (n) + all-gather (n), each padded per bucket to a
        # multiple of dp, plus one 4-byte norm all-reduce (2 x 4 recorded) as control.
        assert b["reduce_scatter"] == b["all_gather"]
        assert 4 * n <= b["reduce_scatter"] < 4 * (n + world)
        assert b["control"] == 8
        assert b["total"] == 2 * b["reduce_scatter"] + 8
    assert off == [0, 0]


def _precision():
    import torch
    import torch.distributed as dist

    import meshtrain
    from meshtrain.errors import TrainingError
    from tests.distributed.training import global_batch, make_model

    out = {}
    out["fp32"] = engine_run("decoder", 20, micro=2, accum=1)[0]
    out["bf16"] = engine_run(
        "decoder", 20, micro=2, accum=1, config_extra={"bf16": {"enabled": True}}
    )[0]
    out["ckpt"] = engine_run(
        "decoder", 5, micro=2, accum=1, config_extra={"activation_checkpointing": {"enabled": True}}
    )[0]

    # fp16: an inf gradient planted on rank 0 at step 3 must skip that step everywhere
    def fp16_engine(**fp16):
        model = make_model("decoder")
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "fp16": {"enabled": True, **fp16},
        }
        engine, *_ = meshtrain.initialize(model=model, config=cfg)
        return engine

    engine = fp16_engine(initial_scale_power=8, hysteresis=1)
    planted = {"step": 3}
    target = engine.module.layers[1].mlp.down_proj.weight

    def plant(grad):
        if engine.global_steps == planted["step"] and dist.get_rank() == 0:
            return grad * float("inf")
        return grad

    target.register_hook(plant)
    trace = []
    for step in range(6):
        ids, _ = global_batch("decoder", step, 4)
        ids = ids[dist.get_rank() * 2 : (dist.get_rank() + 1) * 2]
        before = target.detach().clone()
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        trace.append(
            (
                engine.last_step_skipped,
                engine.loss_scale,
                bool(torch.equal(before, target.detach())),
                math.isfinite(loss.item()),
            )
        )
    out["fp16"] = trace
    out["fp16_dtype"] = str(target.dtype)

    # a model that overflows whatever the scale: stuck at the minimum -> error. By default
    # at once, as DeepSpeed's scaler (raise_error_at_min_scale); with the flag off, after
    # max_overflow_steps_at_min skipped steps in a row
    for key, flags in (
        ("stuck_at_once", {}),
        ("stuck", {"raise_error_at_min_scale": False, "max_overflow_steps_at_min": 3}),
    ):
        engine = fp16_engine(initial_scale_power=1, hysteresis=1, min_loss_scale=1, **flags)
        engine.module.embed.weight.register_hook(lambda g: g * float("nan"))
        try:
            for _ in range(10):
                ids, _ = global_batch("decoder", 0, 2)
                engine.backward(engine(ids, ids))
                engine.step()
            out[key] = None
        except TrainingError as exc:
            out[key] = (str(exc), engine.global_steps)
    return out


def test_precision_and_loss_scaling():
    results = run_ranks(_precision, 2)
    out = results[0]
    for step, (a, b) in enumerate(zip(out["bf16"], out["fp32"], strict=True)):
        check(f"bf16 loss {step}", abs(a - b) / abs(b), against_fp32("bfloat16"))
    assert out["bf16"] != out["fp32"]  # it really ran in bf16
    # activation checkpointing recomputes the same forward: same losses
    assert out["ckpt"] == out["fp32"][:5]
    for r in results:  # identical decisions on both ranks
        assert r["fp16"] == out["fp16"]
    assert out["fp16_dtype"] == "torch.float16"
    skipped = [t[0] for t in out["fp16"]]
    scales = [t[1] for t in out["fp16"]]
    unchanged = [t[2] for t in out["fp16"]]
    assert skipped == [False, False, False, True, False, False]
    assert scales == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0]
    assert unchanged == [False, False, False, True, False, False]
    assert all(t[3] for t in out["fp16"])
    msg, steps = out["stuck"]
    assert "overflowed 3 steps in a row" in msg and "minimum (1)" in msg
    assert steps == 3  # scale 2 -> 1 on the first overflow, then 3 at the minimum
    msg, steps = out["stuck_at_once"]
    assert msg.startswith("Current loss scale already at minimum - cannot decrease scale")
    assert steps == 1  # scale 2 -> 1 on the first overflow; the second raises (DeepSpeed)


def _client_objects():
    import torch

    import meshtrain
    from tests.distributed.training import global_batch, make_model

    model = make_model("plain")
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.SGD(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.5,
        momentum=0.9,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    engine, eopt, _, esched = meshtrain.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        config={"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000},
    )
    lrs = []
    for step in range(5):
        x, y = global_batch("plain", step, 4)
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr())
    return eopt is opt, esched is sched, lrs, [len(g["params"]) for g in opt.param_groups]


def test_client_optimizer_and_scheduler_are_kept():
    same_opt, same_sched, lrs, group_sizes = run_ranks(_client_objects, 2)[0]
    assert same_opt and same_sched
    assert [lr[0] for lr in lrs] == [0.5, 0.25, 0.25, 0.125, 0.125]
    assert all(lr[0] == lr[1] for lr in lrs)
    assert len(group_sizes) == 2


@pytest.mark.parametrize("bad", [{"zero_optimization": {"stage": 4}}])
def test_bad_stage_is_a_config_error(bad):
    from meshtrain.config import load_config
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        load_config(bad)
