"""The config keys that act on the step, each shown to act, on 2 real ranks.

overlap_comm, ignore_unused_parameters, prescale_gradients, gradient_predivide_factor,
communication_data_type, wall_clock_breakdown, checkpoint.tag_validation, and the mesh
sizes (each builds its layout; the parity tests are test_tensor_parallel_* and
test_pipeline_*).

Tolerances: pre-division by a power of two (2 = dp here) is exact in binary floating
point, so those runs equal the default bit for bit. Reducing bf16 gradients in fp32
differs from reducing them in bf16 only by the rounding of one sum of two values
(relative 2^-8 per element), so the losses agree within ``against_fp32("bfloat16")``
(``tests/tolerance.py``). Named ZeRO-3 units regroup the flat buffers the gradients are
reduced in, so those two runs agree within ``trajectory(1e-3, 2)``.
"""

from __future__ import annotations

import pytest

from tests.distributed.training import engine_run, make_engine, max_rel_diff, train_steps
from tests.harness import run_ranks
from tests.tolerance import against_fp32, check, trajectory


def _launched_during_backward(engine) -> int:
    """Collectives recorded while one synchronising backward runs (before it finishes)."""
    from tests.distributed.training import global_batch

    x, y = global_batch("decoder", 0, 2)
    seen = []
    first = next(engine.module.parameters())
    # the embedding's gradient arrives last: count what was launched by then
    first.register_post_accumulate_grad_hook(lambda p: seen.append(engine.topology.stats.calls()))
    before = engine.topology.stats.calls()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return seen[0] - before


def _keys(tmp: str):
    import torch
    import torch.distributed as dist

    from meshtrain.errors import CheckpointError, TrainingError

    out = {}
    # overlap_comm: the same numbers; false launches nothing until backward has ended
    on = make_engine("decoder", 2, 1, {"zero_optimization": {"stage": 1}})
    off = make_engine("decoder", 2, 1, {"zero_optimization": {"stage": 1, "overlap_comm": False}})
    out["overlap_calls"] = (_launched_during_backward(on), _launched_during_backward(off))
    out["overlap_same"] = all(
        torch.equal(a, b)
        for a, b in zip(
            on.module_state_dict().values(), off.module_state_dict().values(), strict=True
        )
    )
    # pre-division: dp = 2 is a power of two, so every variant equals the default exactly
    base = engine_run("decoder", 2, 2, 1)[1]
    for name, extra in (
        ("prescale", {"prescale_gradients": True}),
        ("predivide", {"gradient_predivide_factor": 2.0}),
    ):
        other = engine_run("decoder", 2, 2, 1, extra)[1]
        out[name] = all(torch.equal(base[k], other[k]) for k in base)
    # communication_data_type: bf16 gradients summed in fp32; bytes follow the dtype
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    plain = make_engine("decoder", 2, 1, bf16)
    wide = make_engine("decoder", 2, 1, {**bf16, "communication_data_type": "fp32"})
    lp, bp, _ = train_steps(plain, "decoder", 2, 2, 1)
    lw, bw, _ = train_steps(wide, "decoder", 2, 2, 1)
    out["comm_dtype"] = (
        lp,
        lw,
        bw[-1]["total"] - bw[-1].get("control", 0),
        wide.zero.comm_bytes_theory(1),
        bp[-1]["total"] - bp[-1].get("control", 0),
        plain.zero.comm_bytes_theory(1),
    )
    # ignore_unused_parameters: false names the parameter that got no gradient
    x = torch.randint(0, 64, (2, 8))
    strict = make_engine(
        "decoder", 2, 1, {"zero_optimization": {"ignore_unused_parameters": False}}
    )
    strict.backward(strict(x, x))  # every parameter used: no error
    strict.step()
    partial = make_engine(
        "decoder", 2, 1, {"zero_optimization": {"stage": 2, "ignore_unused_parameters": False}}
    )
    try:  # a loss of the embedding alone leaves every other parameter without a gradient
        partial.backward(partial.module.embed(x).sum())
        out["unused"] = None
    except TrainingError as exc:
        out["unused"] = str(exc)
    # wall_clock_breakdown: the phases are timed and in the line
    timed = make_engine("decoder", 2, 1, {"wall_clock_breakdown": True})
    timed.backward(timed(x, x))
    assert timed.step() is True
    out["breakdown"] = {k: timed.log.last.get(k) for k in ("forward_ms", "backward_ms", "step_ms")}
    out["line"] = timed.log.format(timed.log.last)
    # checkpoint.tag_validation
    rank = dist.get_rank()
    saver = make_engine("decoder", 2, 1)
    path = saver.save_checkpoint(tmp, tag=f"tag{rank}")
    out["warn_tag"] = path.name
    failing = make_engine("decoder", 2, 1, {"checkpoint": {"tag_validation": "fail"}})
    try:
        failing.save_checkpoint(tmp, tag=f"other{rank}")
        out["fail_tag"] = None
    except CheckpointError as exc:
        out["fail_tag"] = str(exc)
    # mesh sizes build their layout
    tp = make_engine("decoder", 1, 1, {"mesh": {"tensor_parallel_size": 2}})
    out["tensor_parallel_size"] = (
        tp.topology.tp_size,
        type(tp.module.layers[0].attn.q_proj).__name__,
    )
    piped = make_engine("decoder", 1, 1, {"mesh": {"pipeline_parallel_size": 2}})
    out["pipeline_parallel_size"] = type(piped.module).__name__
    # stage3_module_classes: the named class is the gather unit; same numbers
    z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    units = make_engine("decoder", 2, 1, {"zero_optimization": z3})
    named = make_engine(
        "decoder", 2, 1, {"zero_optimization": {**z3, "stage3_module_classes": ["Block"]}}
    )
    train_steps(units, "decoder", 2, 2, 1)
    train_steps(named, "decoder", 2, 2, 1)
    out["units"] = (
        len(units.zero.gatherer.units),
        len(named.zero.gatherer.units),
        max_rel_diff(named.module_state_dict(), units.module_state_dict()),
    )
    # engine state: step() says when a window ended, state_dict round-trips
    acc = make_engine("decoder", 1, 2)
    results = []
    for _ in range(2):
        acc.backward(acc(x[:1], x[:1]))
        results.append(acc.step())
    out["step_returns"] = results
    state = acc.state_dict()
    fresh = make_engine("decoder", 1, 2)
    fresh.load_state_dict(state)
    out["state"] = (state, fresh.state_dict())
    return out


@pytest.mark.slow
def test_config_keys_act(tmp_path):
    out = run_ranks(_keys, 2, str(tmp_path))[0]
    on, off = out["overlap_calls"]
    assert on > 0 and off == 0, out["overlap_calls"]
    assert out["overlap_same"]
    assert out["prescale"] and out["predivide"]
    lp, lw, moved_w, theory_w, moved_p, theory_p = out["comm_dtype"]
    assert moved_w == theory_w and moved_p == theory_p
    # stage 2: gradients reduce-scattered (2 -> 4 bytes each), parameters gathered (2)
    assert 2 * moved_w == 3 * moved_p
    for step, (a, b) in enumerate(zip(lp, lw, strict=True)):
        check(f"bf16 reduced in fp32, step {step}", abs(a - b) / abs(a), against_fp32("bfloat16"))
    assert out["unused"] is not None and "lm_head.weight" in out["unused"]
    assert "ignore_unused_parameters" in out["unused"]
    assert all(v is not None and v >= 0 for v in out["breakdown"].values())
    assert "forward" in out["line"] and "backward" in out["line"]
    assert out["warn_tag"] == "tag0"
    assert "tag_validation" in out["fail_tag"] and "'other1'" in out["fail_tag"]
    assert out["tensor_parallel_size"] == (2, "ColumnParallelLinear")
    assert out["pipeline_parallel_size"] == "PipelineStages"  # see test_pipeline_engine
    default_units, named_units, diff = out["units"]
    assert (default_units, named_units) == (5, 2)
    check("named units, parameters", diff, trajectory(1e-3, 2))
    assert out["step_returns"] == [False, True]
    saved, restored = out["state"]
    assert saved == restored and saved["global_steps"] == 1 and saved["micro_steps"] == 2
