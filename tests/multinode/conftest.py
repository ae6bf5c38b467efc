"""Fixtures: a cluster of network-namespace nodes (always torn down) and the one-node run
the multi-node runs must equal.

Where the machine cannot host namespaces or sshd (not root, no ``ip netns``, no
``/usr/sbin/sshd``: ``.ci/run`` installs Debian's openssh-server where it can), every test
here skips and says why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.launch import run_launch
from tests.multinode import JOB, cluster_module

LONG = pytest.mark.skipif(
    os.environ.get("MESHTRAIN_LONG_JOBS") != "1",
    reason="longer job: set MESHTRAIN_LONG_JOBS=1 (tests/multinode)",
)


@pytest.fixture(scope="session")
def cluster_tool():
    tool = cluster_module()
    reason = tool.unavailable()
    if reason:
        pytest.skip(f"no multi-node cluster on this machine: {reason}")
    return tool


@pytest.fixture
def make_cluster(cluster_tool, tmp_path: Path):
    """``make_cluster(n)`` -> a running cluster of n nodes, removed after the test."""
    made = []

    def make(nodes: int):
        c = cluster_tool.Cluster(nodes, tmp_path / f"cluster{len(made)}")
        made.append(c)
        return c.up()

    yield make
    for c in made:
        c.down()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``reference(world, job_args)`` -> final parameters of the job on one node."""
    from tests.multinode import final_state

    done: dict = {}

    def run(world: int, *job_args: str) -> dict:
        key = (world, job_args)
        if key not in done:
            out = tmp_path_factory.mktemp(f"ref{world}")
            r = run_launch("--nproc_per_node", str(world), str(JOB), str(out), *job_args)
            assert r.returncode == 0, r.stderr[-3000:]
            done[key] = final_state(out)
        return done[key]

    return run
