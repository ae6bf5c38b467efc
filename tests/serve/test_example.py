"""examples/serve_classifier.py runs offline: trains a few engine steps under ZeRO-3,
saves a sharded checkpoint with the tokenizer beside it, and loads it as the server does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from meshtrain.serve.model_loading import load
from tests.serve.conftest import live_server

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_classifier.py"


def test_serve_classifier_example(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    save_dir = tmp_path / "ck"
    cmd = [sys.executable, str(EXAMPLE), "--steps", "3", "--batch-size", "8", "--test-size", "64"]
    out = subprocess.run(
        [*cmd, "--save-dir", str(save_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out accuracy" in out.stdout and "ZeRO stage 3" in out.stdout
    assert f"meshtrain serve {save_dir}" in out.stdout
    with live_server(load(save_dir)) as url:
        r = httpx.post(f"{url}/classify", json={"text": "我觉得不错!"})
    assert r.status_code == 200 and r.json()["label"] in ("差评!", "好评!")
