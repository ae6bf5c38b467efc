"""Issue 2's promise: meshtrain processes exit 0 every time after a successful run.

gloo can abort at interpreter exit ("terminate called without an active exception")
when a process group is torn down while a peer is still using it; that shows up only
now and then, so the same small job is launched several times in a row.
"""

from __future__ import annotations

from pathlib import Path

from tests.launch import run_launch

RUNS = 8

SCRIPT = """
import torch
import torch.distributed as dist

import meshtrain

env = meshtrain.init_distributed()  # cleanup (barrier + destroy) is left to atexit
t = torch.ones(4) * (env.rank + 1)
for _ in range(5):
    dist.all_reduce(t)
assert env.world_size == 2 and t[0].item() == 3 * 2**4, t  # [1, 2] -> 3, 6, 12, 24, 48
"""


def test_two_process_gloo_job_exits_zero_every_time(tmp_path: Path):
    script = tmp_path / "allreduce_and_exit.py"
    script.write_text(SCRIPT)
    failures = []
    for run in range(RUNS):
        out = run_launch("--nproc_per_node", "2", str(script), timeout=240)  # bounds a hang
        if out.returncode != 0 or "terminate called" in out.stderr:
            failures.append(f"run {run}: exit code {out.returncode}\n{out.stderr[-2000:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit cleanly:\n" + "\n".join(
        failures
    )
