"""Several nodes for real: the per-node command and the hostfile launcher over ssh.

Each node is a network namespace with its own address (``tools/cluster.py``); a 2-node
data-parallel run must end with parameters identical (``torch.equal``: the same reduction
order, gloo's ring over 2 ranks) to the same job on one node with the same world size.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.multinode import (
    JOB,
    MASTER_PORT,
    REPO,
    collect,
    final_state,
    node_env,
    same_state,
    start_nodes,
)  # fmt: skip
from tests.multinode.conftest import LONG


def _hostfile_launch(cluster, out, slots, *launch):
    hostfile = cluster.hostfile(slots)
    argv = [
        sys.executable, "-u", "-m", "meshtrain", "launch", "--hostfile", str(hostfile),
        "--master_port", str(MASTER_PORT), *launch, str(JOB), str(out),
    ]  # fmt: skip
    env = node_env(cluster, 0, MESHTRAIN_TEST_MARK="from-node-0")
    return cluster.popen(
        0, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )


def _no_processes_left(cluster) -> None:
    time.sleep(0.5)
    left = {i: cluster.pids(i) for i in range(cluster.nodes)}
    assert not any(left.values()), f"processes left in the nodes: {left}"


def test_two_nodes_per_node_command_equal_one_node(make_cluster, reference):
    cluster = make_cluster(2)
    out = cluster.shared / "run"
    out.mkdir()
    runs = collect(start_nodes(cluster, out), time.monotonic())
    for r in runs:
        assert r.code == 0, r.output[-3000:]
        # each node's ranks bound gloo to the node's own interface
        assert "'GLOO_SOCKET_IFNAME': 'eth0'" in r.output, r.output[-2000:]
    assert same_state(final_state(out), reference(2))
    _no_processes_left(cluster)


def test_hostfile_launcher_over_ssh_two_nodes(make_cluster, reference):
    """Node 0 runs ``--hostfile`` and starts node 1 over real ssh; the environment the
    user set on node 0 reaches node 1's ranks."""
    cluster = make_cluster(2)
    out = cluster.shared / "run"
    out.mkdir()
    proc = _hostfile_launch(cluster, out, 1)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text[-3000:]
    assert text.count("'MESHTRAIN_TEST_MARK': 'from-node-0'") == 2, text[-3000:]
    assert "group 1 env" in text  # node 1's rank printed through ssh
    assert same_state(final_state(out), reference(2))
    _no_processes_left(cluster)


@LONG
def test_three_nodes_both_ways_equal_one_node(make_cluster, reference):
    """3 nodes x 1 rank by hand, and 3 nodes of 2, 1 and 1 ranks by hostfile."""
    cluster = make_cluster(3)
    out = cluster.shared / "by-hand"
    out.mkdir()
    runs = collect(start_nodes(cluster, out), time.monotonic())
    assert all(r.code == 0 for r in runs), [r.output[-2000:] for r in runs]
    assert same_state(final_state(out), reference(3))
    out = cluster.shared / "hostfile"
    out.mkdir()
    proc = _hostfile_launch(cluster, out, [2, 1, 1])
    text, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, text[-3000:]
    assert same_state(final_state(out), reference(4))
    _no_processes_left(cluster)


@pytest.mark.parametrize("how", [pytest.param("interrupt", marks=LONG), "launcher killed"])
def test_hostfile_launcher_stopped_leaves_no_rank_on_any_node(make_cluster, how):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) or SIGKILL
    to the launcher mid-run: every node's agent and ranks are gone shortly after."""
    import os
    import signal

    cluster = make_cluster(2)
    out = cluster.shared / "run"
    out.mkdir()
    hostfile = cluster.hostfile(1)
    argv = [
        sys.executable, "-u", "-m", "meshtrain", "launch", "--hostfile", str(hostfile),
        "--master_port", str(MASTER_PORT), str(JOB), str(out), "--steps", "400",
        "--step_sleep", "0.2",
    ]  # fmt: skip
    proc = cluster.popen(
        0, argv, env=node_env(cluster, 0), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    from tests.multinode import wait_for_step

    wait_for_step(out, 1, [(0, proc)])
    assert cluster.pids(1), "node 1 runs nothing: the launcher did not reach it"
    t0 = time.monotonic()
    if how == "interrupt":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        # the launcher alone (ip netns exec execs it: proc.pid is the launcher)
        proc.kill()
    text, _ = proc.communicate(timeout=120)
    end = time.monotonic() + 60
    while time.monotonic() < end and any(cluster.pids(i) for i in range(2)):
        time.sleep(0.2)
    gone = time.monotonic() - t0
    left = {i: cluster.pids(i) for i in range(2)}
    assert not any(left.values()), f"orphans after {how}: {left}\n{text[-3000:]}"
    print(f"{how}: every node empty {gone:.1f} s after")
