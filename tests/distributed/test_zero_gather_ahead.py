"""ZeRO-1/2's parameter all-gather overlapped with the next forward (``gather_ahead``).

The overlap moves only *when* each bucket is waited for, so the run with
``overlap_param_gather: true`` must be bit-identical (losses and every parameter, tolerance
0) to the same run with the default ``false``, which waits at the end of the step. Small
buckets (2,000 elements) give several per model; the tied decoder checks that a weight
owned by two modules is waited for by the first. Also asserted: right after ``step()``
every bucket's all-gather is pending, the forward alone (its pre-hooks) finishes them
all, and ``module.state_dict()`` read straight after a step waits for them.
"""

from __future__ import annotations

from tests.distributed.training import global_batch, make_engine
from tests.harness import run_ranks


def _run(kind: str, stage: int, overlap: bool, steps: int = 4):
    import torch.distributed as dist

    z = {"stage": stage, "overlap_param_gather": overlap, "reduce_bucket_size": 2000}
    engine = make_engine(kind, 2, 1, {"zero_optimization": z})
    rank, world = dist.get_rank(), dist.get_world_size()
    ahead = engine.zero.dense.ahead  # the one part (no experts)
    n_buckets = sum(len(g.buckets) for g in engine.zero.dense.gathered_groups)
    checks, losses = [], []
    for step in range(steps):
        x, y = global_batch(kind, step, 2 * world)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        loss = engine(x, y)
        if ahead is not None:
            checks.append(ahead.pending == 0)  # the forward's hooks waited for every bucket
        engine.backward(loss)
        engine.step()
        if ahead is not None:
            checks.append(ahead.pending == n_buckets)  # launched, not waited
        losses.append(loss.item())
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}  # waits (pre-hook)
    if ahead is not None:
        checks.append(ahead.pending == 0)
    return losses, state, checks, n_buckets


def _all():
    import torch

    out = {}
    for kind in ("decoder", "tied"):
        for stage in (1, 2):
            on, off = _run(kind, stage, True), _run(kind, stage, False)
            same = on[0] == off[0] and all(torch.equal(on[1][k], off[1][k]) for k in off[1])
            out[kind, stage] = (same, all(on[2]), on[3], off[2] == [])
    return out


def test_overlapped_gather_is_bit_identical_and_waited_by_the_forward():
    for rank_out in run_ranks(_all, 2):
        for (kind, stage), (same, waited, n_buckets, off_has_no_ahead) in rank_out.items():
            assert n_buckets > 2, (kind, stage, n_buckets)
            assert same, f"{kind} stage {stage}: overlap changed losses or parameters"
            assert waited, f"{kind} stage {stage}: pending all-gathers not as expected"
            assert off_has_no_ahead
