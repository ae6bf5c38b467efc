"""A rank SIGKILLed mid-run under ``torchrun --max-restarts=1``: the job restarts, loads
``latest`` and ends with parameters bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the fault campaigns' training job: rank 1 SIGKILLs itself after step KILL_AT
WORKER = Path(__file__).resolve().parents[1] / "faults" / "worker.py"


def _torchrun(out_dir: Path, kill_at: int) -> tuple[int, str]:
    """Run the worker under torchrun; (exit code, its output). The output goes to a file
    so that a hang still shows what happened."""
    out_dir.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.5", str(WORKER), "train", str(out_dir),
        "1", str(kill_at),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = out_dir / "torchrun.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=240, env=env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun hung; its output:\n{log.read_text()[-4000:]}")
    return rc.returncode, log.read_text()


@pytest.mark.slow
def test_killed_rank_recovers_bit_identical(tmp_path):
    from safetensors.torch import load_file

    rc, log = _torchrun(tmp_path / "straight", -1)
    assert rc == 0, log[-3000:]
    rc, log = _torchrun(tmp_path / "killed", 4)  # the 5th step, one past global_step4
    assert rc == 0, log[-3000:]
    assert "resumed at step 4" in log, log[-3000:]  # the restart found global_step4
    want = load_file(str(tmp_path / "straight" / "final.safetensors"))
    got = load_file(str(tmp_path / "killed" / "final.safetensors"))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_zero3_resume_example_runs_and_resumes_on_another_world_size(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "zero3_resume.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(nproc: int, *args: str) -> str:
        cmd = [sys.executable, "-m", "meshtrain", "launch", "--nproc_per_node", str(nproc)]
        cmd += [str(example), "--save-dir", str(tmp_path / "ckpt"), "--save-every", "2", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    first = launch(2, "--steps", "4")
    assert "step    4" in first and "measured / formula" in first
    second = launch(1, "--steps", "6", "--stage", "1")
    assert "at step 4" in second and "step    6" in second
