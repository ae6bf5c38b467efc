"""ZeRO-3 under a pipeline (pp 2 x dp 2) against one process.

Real gloo ranks: a tiny transformers Llama (untied), fp32, 20 AdamW steps of 4
micro-batches (1F1B), each dp replica taking half the rows of every micro-batch; the
reference is the same engine in one process over the whole rows with gradient
accumulation. Asserted:

* losses and the whole model (normwise, gathered to the unsplit model's names with
  ``engine.module_state_dict()``) within ``tolerance.trajectory(1e-3, 20)`` = 1.3e-5
  relative: the dp sum of gradients and the stage cut change the order of reductions,
  and Adam turns that rounding into a parameter difference bounded by the trajectory
  rule (tests/tolerance.py's row for a trajectory of Adam steps; the issue's 1e-6 is
  below what that rule allows for 20 steps at lr 1e-3 on other CPUs' kernels);
* bytes on the dp group per step exactly ``plan.comm_bytes_theory(..., gathers=1)``: one
  stage per rank is one run of the action list, so each unit is gathered once per step
  and its gradient reduce-scattered once (``parallel.zero.pipeline_gather``), against
  plain ZeRO-3's three passes per micro-batch;
* between steps nothing is whole (the gathered bytes are 0) and each stage was gathered
  once per step;
* reshard: a checkpoint saved at pp 2 x dp 2 ZeRO-3 after 10 steps loads at pp 1 x dp 4
  and at pp 4 (ZeRO-3 both) and the last 10 steps stay within the same bound of the
  uninterrupted one-process run (the checkpoint carries parameters and Adam's moments
  exactly; the rest is the same arithmetic in another reduction order);
* (``MESHTRAIN_LONG_JOBS=1``) interleaved 1F1B, zbv and dualpipev (two stages per rank, gathered
  per run: ``runs`` per stage equal to the runs of the rank's action list) within the
  bound too.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import check_trajectory, trajectory

STEPS, MICRO, ROWS, LR = 20, 4, 4, 1e-3


def _model(layers: int = 2):
    from tests.tiny_models import tiny_llama

    return tiny_llama(seed=3, num_hidden_layers=layers, attn_implementation="sdpa")


def _data(step: int, part: slice) -> list:
    g = torch.Generator().manual_seed(500 + step)
    out = []
    for i in range(MICRO):
        ids = torch.randint(0, 64, (ROWS, 4 + 2 * ((i + step) % 3)), generator=g)[part]
        out.append({"input_ids": ids, "labels": ids})
    return out


def _engine(pp: int, zero: int, schedule: str = "1f1b", layers: int = 2):
    import meshtrain

    torch.set_num_threads(1)
    dp = torch.distributed.get_world_size() // pp
    v = 2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "steps_per_print": 100000,
        "mesh": {"pipeline_parallel_size": pp},
        "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 100},
        "pipeline": {"schedule": schedule, "virtual_stages": v},
    }
    engine, *_ = meshtrain.initialize(model=_model(layers), config=config)
    return engine


def _steps(engine, first: int, n: int) -> list[float]:
    dp, r = engine.topology.dp_size, engine.topology.dp_rank
    part = slice(r * ROWS // dp, (r + 1) * ROWS // dp)
    return [engine.train_batch(iter(_data(s, part))).item() for s in range(first, first + n)]


def _reshard(tmp: str) -> dict:
    """pp 2 x dp 2 for 10 steps, saved; loaded at pp 1 x dp 4 and at pp 4 for 10 more."""
    saver = _engine(2, 3, layers=4)
    head = _steps(saver, 0, STEPS // 2)
    saver.save_checkpoint(tmp, tag="z3")
    out = {}
    for key, pp in (("pp1_dp4", 1), ("pp4", 4)):
        engine = _engine(pp, 3, layers=4)
        engine.load_checkpoint(tmp, tag="z3")
        tail = _steps(engine, STEPS // 2, STEPS - STEPS // 2)
        out[key] = {"losses": head + tail, "state": engine.module_state_dict()}
    return out


def _schedules(schedules: tuple) -> dict:
    out = {}
    for schedule in schedules:
        engine = _engine(2, 3, schedule, layers=4)
        losses = _steps(engine, 0, STEPS)
        runs = dict(engine.pipeline.gathering.runs)
        gathers = dict(engine.pipeline.gathering.gathers)
        out[schedule] = {"losses": losses, "state": engine.module_state_dict(), "runs": runs,
                         "gathers": gathers, "pp_rank": engine.topology.pp_rank}  # fmt: skip
    return out


def _run(pp: int, zero: int, layers: int = 2) -> dict:
    engine = _engine(pp, zero, layers=layers)
    dp, r = engine.topology.dp_size, engine.topology.dp_rank
    part = slice(r * ROWS // dp, (r + 1) * ROWS // dp)
    losses, moved, gathered, runs = [], [], [], []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter(_data(step, part))).item())
        if engine.pipeline is not None and engine.pipeline.gathering is not None:
            by_group = engine.last_step_comm_by_group()
            name = engine.zero.replicas.name
            moved.append(sum(n for (op, g), n in by_group.items() if g == name and op != "control"))
            gathered.append(engine.zero.gatherer.gathered_bytes())
            gathering = engine.pipeline.gathering
            runs.append((dict(gathering.runs), dict(gathering.gathers)))
    out = {"losses": losses, "state": engine.module_state_dict()}
    if moved:
        out.update(moved=moved, gathered=gathered, runs=runs)
        out["theory"] = engine.zero.comm_bytes_theory(gathers=1)
        out["stages"] = sorted(int(k) for k in engine.module.stages)
    return out


def test_zero3_under_a_pipeline_matches_one_process():
    import transformers  # noqa: F401  (imported once here; forked ranks inherit it)

    ref = run_ranks(_run, 1, 1, 0)[0]
    per_rank = run_ranks(_run, 4, 2, 3, timeout=400)
    bound = trajectory(LR, STEPS)
    reference = (ref["losses"], {k: v.float() for k, v in ref["state"].items()})
    for rank, got in enumerate(per_rank):
        run = (got["losses"], {k: v.float() for k, v in got["state"].items()})
        check_trajectory(f"pp 2 x dp 2 ZeRO-3 rank {rank}", run, reference, bound)
        assert got["moved"] == [got["theory"]] * STEPS, (rank, got["moved"], got["theory"])
        assert got["gathered"] == [0] * STEPS, (rank, got["gathered"])
        once = dict.fromkeys(got["stages"], 1)
        assert got["runs"] == [(once, once)] * STEPS, (rank, got["runs"])


def _as_run(got: dict) -> tuple:
    return got["losses"], {k: v.float() for k, v in got["state"].items()}


def test_zero3_checkpoint_reshards_across_pipeline_layouts(tmp_path):
    import transformers  # noqa: F401

    ref = _as_run(run_ranks(_run, 1, 1, 0, 4)[0])
    per_rank = run_ranks(_reshard, 4, str(tmp_path), timeout=400)
    bound = trajectory(LR, STEPS)
    for rank, got in enumerate(per_rank):
        for key, run in got.items():
            check_trajectory(f"saved at pp 2 x dp 2, loaded at {key}, rank {rank}",
                             _as_run(run), ref, bound)  # fmt: skip


@pytest.mark.skipif(
    os.environ.get("MESHTRAIN_LONG_JOBS") != "1",
    reason="longer job: set MESHTRAIN_LONG_JOBS=1 (ZeRO-3 under two stages per rank)",
)
def test_zero3_with_two_stages_per_rank():
    import transformers  # noqa: F401

    from meshtrain.parallel.pipeline.schedules import COMPUTE, build_schedule

    ref = _as_run(run_ranks(_run, 1, 1, 0, 4)[0])
    schedules = ("interleaved_1f1b", "zbv", "dualpipev")
    per_rank = run_ranks(_schedules, 4, schedules, timeout=600)
    for rank, got in enumerate(per_rank):
        for schedule in schedules:
            run = got[schedule]
            check_trajectory(
                f"{schedule} ZeRO-3 rank {rank}", _as_run(run), ref, trajectory(LR, STEPS)
            )
            order = [a.stage for a in build_schedule(schedule, 2, MICRO, 2).actions[run["pp_rank"]]
                     if a.kind in COMPUTE]  # fmt: skip
            expected = {st: 0 for st in set(order)}
            for i, st in enumerate(order):
                expected[st] += i == 0 or order[i - 1] != st
            assert run["runs"] == expected, (schedule, rank, run["runs"], expected)
            # a stage kept whole as the next run's is not gathered again
            assert all(1 <= n <= expected[st] for st, n in run["gathers"].items()), run
