"""``meshtrain.notebook_launcher`` on functions defined in ``__main__`` (as in a notebook).

The function under test must live in a real ``__main__``, so each check runs a small
script in a subprocess: it defines the functions at top level and calls the launcher.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.errors import ConfigError
from tests.launch import clean_env

SCRIPT = """
import torch
import torch.distributed as dist

import meshtrain
from meshtrain.launch.processes import RankFailedError


def train(scale):  # defined in __main__: not importable, so the ranks must be forked
    env = meshtrain.init_distributed()  # the group already exists: returns its place
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    return env.rank, env.world_size, t.item() * scale


def explode(code):
    if dist.get_rank() == 1:
        raise ValueError(f"rank one exploded with code {code}")
    dist.barrier()  # rank 0 waits here; the launcher must stop it


if __name__ == "__main__":
    print("OK", meshtrain.notebook_launcher(train, args=(10.0,), num_processes=2))
    try:
        meshtrain.notebook_launcher(explode, (42,), num_processes=2, timeout=240)
    except RankFailedError as exc:
        print("RAISED", type(exc).__name__, "rank", exc.rank, exc.exc_type)
        print(exc)
    # an earlier cell set up a group in this process: refused with the way out, which works
    meshtrain.init_distributed()
    try:
        meshtrain.notebook_launcher(train, args=(1.0,), num_processes=2)
    except meshtrain.errors.DistributedError as exc:
        print("REFUSED", exc)
    dist.destroy_process_group()
    print("AFTER", meshtrain.notebook_launcher(train, args=(1.0,), num_processes=2))
"""


def test_main_defined_function_on_two_ranks_rank1_failure_and_parent_group(tmp_path: Path):
    script = tmp_path / "notebook_like.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=400,
        env=clean_env(), cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "OK [(0, 2, 30.0), (1, 2, 30.0)]" in out.stdout
    assert "RAISED RankFailedError rank 1 ValueError" in out.stdout
    # the failing rank's own message and traceback travel with the error
    assert "rank one exploded with code 42" in out.stdout
    assert "in explode" in out.stdout and "--- traceback from rank 1 ---" in out.stdout
    assert "REFUSED cannot fork ranks" in out.stdout
    assert "destroy_process_group() first" in out.stdout
    assert "AFTER [(0, 2, 3.0), (1, 2, 3.0)]" in out.stdout


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_num_processes_must_be_a_positive_int(bad):
    from meshtrain import notebook_launcher

    with pytest.raises(ConfigError, match="num_processes"):
        notebook_launcher(print, num_processes=bad)
