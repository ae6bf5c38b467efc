"""Seed 001's DeepSpeed script shape, run as users run it: ``examples/deepspeed_style``.

``main.py`` does ``import meshtrain as deepspeed``, builds its argparse parser with
``deepspeed.add_config_arguments``, calls ``deepspeed.initialize(args=...)`` and is started
by ``meshtrain launch --hostfile hostfile main.py --deepspeed --deepspeed_config
ds_config.json`` (hostfile: ``localhost slots=2``) -- 2 real processes on gloo.

* run A: 6 optimizer steps (2 micro-batches each), a checkpoint at step 4 only: the step
  lines show on stdout without any logging set-up, ``load_checkpoint`` on the empty
  output directory returns ``(None, None)`` with a warning;
* run B: the same command resumes from ``latest`` (step 4) with the ``client_state`` it
  saved, skips the data it had seen, and its losses for micro-steps 8-11 equal run A's
  exactly (resume restores masters, Adam moments and the schedule bit for bit);
* run C: the same file with the import line changed to ``import deepspeed``, on real
  DeepSpeed (CPU accelerator, torchrun, same config: no "auto", clipping 1.0 on both
  sides, torch's AdamW via ``torch_adam``): its losses match run A's within 1e-5
  relative. Both run the same fp32 operations; only the order of the gradient
  reductions differs (DeepSpeed averages before summing across ranks), which moves the
  parameters by ~1e-7 relative per step; 1e-5 leaves room over 12 micro-steps (measured:
  equal to all 8 printed decimals).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.launch.processes import free_port
from tests.launch import REPO, clean_env, run_launch

EXAMPLE = REPO / "examples" / "deepspeed_style"
LOSS = re.compile(r"^micro (\d+) loss ([0-9.]+)$", re.M)


def _losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(stdout)}


def _launch(out: Path, max_steps: int) -> subprocess.CompletedProcess:
    return run_launch(
        "--hostfile",
        "hostfile",
        "--master_port",
        str(free_port()),
        "main.py",
        "--deepspeed",
        "--deepspeed_config",
        "ds_config.json",
        "--output_dir",
        str(out),
        "--max_steps",
        str(max_steps),
        "--save_steps",
        "4",
        cwd=EXAMPLE,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("seed001") / "out"
    return out, _launch(out, 6)


def test_runs_under_hostfile_launch_prints_steps_saves_and_resumes(run_a):
    out, a = run_a
    assert a.returncode == 0, a.stderr[-3000:]
    assert "load_checkpoint:" in a.stdout + a.stderr and "does not exist" in a.stdout + a.stderr
    steps = re.findall(r"^\[meshtrain\] step (\d+) \| loss ", a.stdout, re.M)
    assert steps == ["2", "4", "6"], a.stdout
    assert (out / "latest").read_text().strip() == "global_step4"
    losses_a = _losses(a.stdout)
    assert sorted(losses_a) == list(range(12))

    b = _launch(out, 6)
    assert b.returncode == 0, b.stderr[-3000:]
    assert f"resumed from {out} after 8 micro-steps" in b.stdout
    assert re.findall(r"^\[meshtrain\] step (\d+) \| loss ", b.stdout, re.M) == ["6"]
    losses_b = _losses(b.stdout)
    assert sorted(losses_b) == [8, 9, 10, 11]
    for i in losses_b:
        assert losses_b[i] == losses_a[i], (i, losses_b[i], losses_a[i])


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_same_script_on_real_deepspeed_gives_the_same_losses(run_a, tmp_path):
    _, a = run_a
    assert a.returncode == 0, a.stderr[-3000:]
    source = (EXAMPLE / "main.py").read_text()
    assert source.count("import meshtrain as deepspeed\n") == 1
    script = tmp_path / "main.py"
    script.write_text(source.replace("import meshtrain as deepspeed\n", "import deepspeed\n"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    argv += ["--master_port", str(free_port()), str(script), "--deepspeed"]
    argv += ["--deepspeed_config", str(EXAMPLE / "ds_config.json")]
    argv += ["--output_dir", str(tmp_path / "out"), "--max_steps", "6", "--save_steps", "0"]
    # the first DeepSpeed run on a machine JIT-compiles a small CPU op (~35 s idle)
    c = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=clean_env(DS_ACCELERATOR="cpu"),
    )
    assert c.returncode == 0, c.stderr[-3000:]
    ours, theirs = _losses(a.stdout), _losses(c.stdout)
    assert sorted(theirs) == list(range(12)), c.stdout[-3000:]
    for i in range(12):
        assert abs(ours[i] - theirs[i]) <= 1e-5 * abs(theirs[i]), (i, ours[i], theirs[i])
