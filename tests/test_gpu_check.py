"""``benchmarks/gpu_check.py --dry-run``: the GPU proof's own code, run on the CPU.

The script runs on a GPU machine where nothing can be fixed mid-run, so CI runs the
same sections on tiny sizes: every section must come back "ok" here. ``pytest_gpu``
(pytest inside pytest) and ``trainers`` (transformers' Trainer in a subprocess, ~1
minute) are left out to keep this short; both ran in the dry run by hand and on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_dry_run_every_section_ok(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path),
         "--skip", "pytest_gpu,trainers"],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["_meta"]["finished"] and res["_meta"]["dry_run"]
    ran = [k for k in res if not k.startswith("_")]
    assert set(ran) == set(_module().SECTIONS) - {"pytest_gpu", "trainers"}
    bad = {k: res[k].get("error", res[k]) for k in ran if res[k]["status"] != "ok"}
    assert not bad, bad
    # the checks inside the sections, not only their verdicts
    steps = res["engine_precision"]["fp16_steps"]
    assert [s["applied"] for s in steps] == [True, False, True]
    assert steps[1]["scale_after"] == steps[1]["scale_before"] / 2
    assert res["checkpoint"]["cpu_load_max_abs_diff"] == 0.0
    assert res["checkpoint"]["gpu_reload_max_abs_diff"] == 0.0
    assert res["mfu_fp8"]["fp8_layers"] > 0
    assert "Float8Linear" not in res["mfu_engine"].get("profile_top", "")
    for name in ("zero2_offload_optimizer", "zero3_offload_param"):
        assert res["zero_offload"][name]["max_loss_rel_vs_plain"] <= 2e-3
    table = (tmp_path / "gpu_check.md").read_text()
    for name in ran:
        assert f"| {name} | ok" in table


def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    mod = _module()

    def boom(ctx):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(mod.FUNCS, "env", boom)
    monkeypatch.setitem(mod.FUNCS, "matmul_peak", lambda ctx: {"ok": True, "bf16_tflops": 1.5})
    monkeypatch.setitem(mod.FUNCS, "memory", lambda ctx: {"ok": False})
    assert mod.run(["--dry-run", "--out", str(tmp_path), "--only", "env,matmul_peak,memory"]) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["status"] == "error" and "planted failure" in res["env"]["error"]
    assert res["matmul_peak"]["status"] == "ok" and res["memory"]["status"] == "failed"
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| env | error | error: RuntimeError: planted failure |" in table
    assert "| matmul_peak | ok | bf16_tflops 1.5 |" in table


def test_a_section_past_the_deadline_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    mod = _module()
    monkeypatch.setitem(mod.FUNCS, "env", lambda ctx: {"ok": True})
    args = ["--dry-run", "--out", str(tmp_path), "--only", "env", "--deadline-s", "0"]
    assert mod.run(args) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["status"] == "skipped" and "deadline" in res["env"]["reason"]


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit):
        _module().run(["--dry-run", "--out", "x", "--only", "mfu"])
    assert "unknown section 'mfu'" in capsys.readouterr().err
