"""Rank 0's outputs: the JSONL log across a resume, and the loss plot. No processes."""

from __future__ import annotations

import json

from meshtrain.trainer.run_log import METRICS, RunLog, plot_loss, read_metrics


def _last(step: int, loss: float) -> dict:
    """What ``engine.log.last`` holds after a step."""
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": float("nan"),  # JSON has no NaN: written as null
        "loss_scale": 1.0,
        "tokens_per_s": 100.0,
        "samples_per_s": 2.0,
        "comm_bytes": 64,
        "skipped": False,
        "seconds": 0.5,
    }


def test_jsonl_rows_and_resume_drops_steps_after_the_checkpoint(tmp_path):
    with RunLog(tmp_path, start_step=0, max_steps=5, tensorboard_dir=None, progress=False) as log:
        for step in range(1, 6):
            log.step(_last(step, 9.0 - step))
    rows = read_metrics(tmp_path / METRICS)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["grad_norm"] is None and rows[0]["comm_bytes"] == 64
    # a torn last line (a crash mid-write) is skipped, not fatal
    with open(tmp_path / METRICS, "a") as f:
        f.write('{"step": 6, "lo')
    assert len(read_metrics(tmp_path / METRICS)) == 5
    # resumed from the checkpoint of step 3: steps 4-5 are trained again, logged once
    with RunLog(tmp_path, start_step=3, max_steps=6, tensorboard_dir=None, progress=False) as log:
        for step in range(4, 7):
            log.step(_last(step, 1.0))
        assert [r["step"] for r in log.rows] == [4, 5, 6]
    rows = [json.loads(line) for line in (tmp_path / METRICS).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[3]["loss"] == 1.0


def test_plot_is_a_png(tmp_path):
    with RunLog(tmp_path, start_step=0, max_steps=3, tensorboard_dir=None, progress=False) as log:
        for step in range(1, 4):
            log.step(_last(step, 5.0 - step))
    assert plot_loss(tmp_path / METRICS, tmp_path / "loss.png", "test", resumed_at=2)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
