"""The same Trainer script under ``python script.py`` (one process, no launcher
environment) and ``meshtrain launch --nproc_per_node 2``: it trains the steps the world
size implies and evaluates the same 9 rows. (notebook_launcher is the harness every
multi-rank test here runs on.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.launch import clean_env, run_launch

SCRIPT = Path(__file__).with_name("script_xy.py")


def _results(stdout: str) -> list[dict]:
    return [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def test_plain_python_and_meshtrain_launch(tmp_path):
    plain = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "one")],
        capture_output=True, text=True, timeout=900, env=clean_env(),
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    (one,) = _results(plain.stdout)
    assert one["steps"] == 4  # 32 rows / 8
    assert "***** Running training *****" in plain.stdout
    launched = run_launch("--nproc_per_node", "2", str(SCRIPT), str(tmp_path / "two"), timeout=900)
    assert launched.returncode == 0, launched.stderr[-3000:]
    two = _results(launched.stdout)
    assert sorted(r["rank"] for r in two) == [0, 1]
    assert all(r["steps"] == 2 for r in two)  # 32 rows / (8 x 2)
    assert two[0]["eval_loss"] == two[1]["eval_loss"]  # every rank gets the gathered result
