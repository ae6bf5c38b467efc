"""Asynchronous save (``checkpoint.async_save``) and pre-emption in an engine user loop.

Checkpoints hold exact copies of fp32 values and resumed runs repeat the same fp32
operations in the same order, so every comparison here is exact (no tolerance).
"""

from __future__ import annotations

import signal

from tests.checkpoint import async_ranks
from tests.harness import run_ranks


def test_async_save_equals_sync_and_surfaces_failures(tmp_path):
    results = run_ranks(async_ranks.async_matches_sync, 2, str(tmp_path))
    for r in results:
        assert r["same_bytes"], "the async checkpoint differs from the sync one at step 2"
        assert r["steps"] == (2, 2)
        assert r["same_losses"]  # the background write does not change training
        assert r["path"].endswith("global_step2") and r["done"].endswith("second")
        assert r["latest"] == "second"
        assert r["failure"] is not None and "asynchronous save" in r["failure"], r
        assert "'global_step4'" in r["failure"]  # names the tag that failed
        assert r["after_failure"] == "after_failure"
        assert r["resumed_exact"]
    assert not (tmp_path / "blocker" / "ckpt").exists()


def test_preemption_in_user_loop_saves_on_every_rank(tmp_path):
    """SIGTERM on rank 1 during step 3 (an index: the 4th step); a SIGUSR1 during the
    save on rank 0 is counted and ignored. Both ranks stop after the same step with
    code 75, and the checkpoint holds that step."""
    from meshtrain.checkpoint import CheckpointReader, latest_tag

    results = run_ranks(async_ranks.preempt_user_loop, 2, str(tmp_path), 3, True)
    assert [r["code"] for r in results] == [75, 75]
    steps = {r["step"] for r in results}
    assert steps == {4}, results  # the signal landed in step index 3: stop after it
    assert results[1]["received"] == [signal.SIGTERM]
    assert results[0]["received"] == [signal.SIGUSR1]  # the second signal, during the save
    ckpt = tmp_path / "ckpt"
    assert latest_tag(ckpt) == "global_step4"
    with CheckpointReader(ckpt) as r:
        assert r.meta["global_steps"] == 4
