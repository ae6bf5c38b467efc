"""Tests of ``meshtrain launch``, the hostfile fan-out and ``notebook_launcher``.

``run_launch`` runs the real command in a subprocess (with a hard timeout so nothing
hangs CI) and without any SLURM variables of the machine running the tests, which would
otherwise change what the launcher decides. GPUs are hidden from these jobs: they test
the launcher on gloo, and two ranks sharing one GPU would not form an NCCL group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELLO = REPO / "examples" / "launch_hello.py"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without SLURM/torchrun variables or GPUs, plus ``extra``."""
    drop = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def run_launch(
    *argv: str, timeout: float = 300, cwd: str | Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -m meshtrain launch ARGV`` to completion; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "meshtrain", "launch", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env or clean_env(),
    )
