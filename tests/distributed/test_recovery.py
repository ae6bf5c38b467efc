"""A rank SIGKILLed mid-run under ``torchrun --max-restarts=1``: the job restarts, loads
``latest`` and ends with parameters bit-identical to an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("recovery_worker.py")


def _torchrun(out_dir: Path, kill_at: int) -> subprocess.CompletedProcess:
    out_dir.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.5", str(WORKER), str(out_dir),
        str(kill_at),
    ]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_killed_rank_recovers_bit_identical(tmp_path):
    from safetensors.torch import load_file

    straight = _torchrun(tmp_path / "straight", -1)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _torchrun(tmp_path / "killed", 4)  # the 5th step, one past global_step4
    assert killed.returncode == 0, killed.stderr[-3000:]
    log = killed.stdout + killed.stderr
    assert "resumed at step 4" in log, log[-3000:]  # the restart found global_step4
    want = load_file(str(tmp_path / "straight" / "final.safetensors"))
    got = load_file(str(tmp_path / "killed" / "final.safetensors"))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
