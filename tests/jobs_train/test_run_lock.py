"""``meshtrain train`` refuses an output folder it cannot use, before any work (issue 18).

Real ``meshtrain train`` processes; each fails before tokenizing, so this is quick.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from meshtrain.jobs.train.run_lock import LOCK_NAME, RunLock


def _train(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": ""}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "--no-progress", *argv],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_output_dir_checks_and_the_run_lock(tmp_path: Path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    out = _train("--output-dir", str(a_file), "--max-steps", "1")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"meshtrain train: error: train.output_dir: {a_file} exists and is a file, not a "
        "folder; pick another --output-dir or move the file away"
    )

    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):  # another run holds the folder
        out = _train("--output-dir", str(run), "--max-steps", "1")
        assert out.returncode == 2, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert f"is in use by another meshtrain train run (pid {os.getpid()} on host" in last
        assert "pick another --output-dir" in last
        assert not (run / "config.json").exists()  # nothing of the other run touched
    assert f"pid {os.getpid()}" in (run / LOCK_NAME).read_text()
    with RunLock(run):  # released on exit: the next run gets it
        pass
