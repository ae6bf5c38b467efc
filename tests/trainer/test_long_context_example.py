"""examples/long_context_sft.py through the Trainer: packed rows at cp 2 (two processes,
``meshtrain launch``) train exactly as one process at cp 1 on the same rows.

Short rows (256 tokens) and 3 steps keep it quick; the example's default is 8k. The
per-step losses agree within ``trajectory(1e-3, 3)`` relative (``tests/tolerance.py``;
fp32, cp sums in another order) plus the resolution of the Trainer's logged loss, which is
rounded to 4 decimals: two rounded values differ by up to 1e-4 more than the values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tolerance import check, trajectory

LOGGED_RESOLUTION = 1e-4  # two values rounded to 4 decimals differ by this much more
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_context_sft.py"


def _run(tmp_path: Path, cp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = ["--seq-len", "256", "--steps", "3", "--cp", str(cp)]
    args += ["--output-dir", str(tmp_path / f"cp{cp}")]
    if cp == 1:
        cmd = [sys.executable, str(EXAMPLE), *args]
    else:
        launch = [sys.executable, "-m", "meshtrain", "launch", "--nproc_per_node", str(cp)]
        cmd = [*launch, str(EXAMPLE), *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith('{"seq_len"')]
    assert len(line) == 1, out.stdout[-3000:]
    return json.loads(line[0])


def test_long_context_example_cp2_equals_one_process(tmp_path):
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    assert two["cp"] == 2 and two["method"] == "ring"
    assert len(two["losses"]) == 3
    for step, (a, b) in enumerate(zip(two["losses"], one["losses"], strict=True)):
        check(f"loss {step}", abs(a - b), LOGGED_RESOLUTION + trajectory(1e-3, 3) * abs(b))
    # packed rows hold no padding; one document per padded row would need more tokens
    assert two["real_token_fraction"] == 1.0
    assert two["padded_batch_tokens_for_same_documents"] > two["packed_tokens_for_same_documents"]
