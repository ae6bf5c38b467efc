"""The hang doctor across nodes: two ``meshtrain launch`` on 127.0.0.1 acting as nodes 0/1.

Each node runs one process of ``doctor_worker.py`` (static rendezvous: ``--nnodes 2
--node_rank 0/1 --master_addr 127.0.0.1``). Rank 1, on node 1, goes wrong before
all_reduce #14; rank 0, on node 0, fails in that collective and node 0's launcher reports.
Node 0's doctor folder holds only rank 0's record, so naming rank 1 -- its reason, its
node and where it was -- proves the table was built from the rendezvous store.

The deadline (generous: the collective timeout, 6 s, plus two launchers and two workers
importing torch on a loaded shared 2-core machine, where one such launch took 60 s) only
bounds a hang; no assertion on the time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.launch.processes import free_port
from tests.launch import REPO, clean_env

WORKER = REPO / "tests" / "distributed" / "doctor_worker.py"
DEADLINE_S = 240


def _node(rank: int, port: int, mode: str, run_dir: Path) -> subprocess.Popen:
    flags = ["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank)]
    flags += ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    return subprocess.Popen(
        [sys.executable, "-m", "meshtrain", "launch", *flags, str(WORKER), mode, str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(PYTHONPATH=os.pathsep.join(sys.path)),
        start_new_session=True,  # so the whole node (agent and worker) can be stopped
    )


def _stop(p: subprocess.Popen) -> None:
    """End a node that is still running, its worker included.

    Node 1's agent (static rendezvous) cannot see that node 0 is gone: a rank stuck in
    Python there stays stuck, and a finished one waits in torch's exit barrier. SIGTERM
    makes the agent stop its worker (which runs in a session of its own); a launcher
    deaf to it in the exit barrier has no worker left, and is killed with its group.
    """
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)


@pytest.mark.parametrize(
    "mode, says, verdict",
    [
        (
            "exit0",
            "left the job early (its own node's launcher has its exit code) while its peers "
            "still needed it",
            "rank 1 left the job (its process ended) at ",
        ),
        (
            "hang",
            "stalled (no collective for ",
            "rank 1 never entered all_reduce #14 on the dp group (last seen at ",
        ),
    ],
)
def test_report_names_the_remote_rank_from_the_store(tmp_path: Path, mode, says, verdict):
    port = free_port()
    runs = [tmp_path / "node0", tmp_path / "node1"]
    for d in runs:
        d.mkdir()
    nodes = [_node(r, port, mode, runs[r]) for r in (0, 1)]
    try:
        _out, err = nodes[0].communicate(timeout=DEADLINE_S)
    finally:
        for p in nodes:
            _stop(p)
    assert nodes[0].returncode == 1, err[-3000:]
    assert "failed: rank 1 (local rank 0 on node 1, host " in err, err[-3000:]
    assert says in err
    assert "; also failed: rank 0 (exited with code 1)" in err
    report = json.loads((runs[0] / "doctor.json").read_text())
    assert report["culprit"] == 1
    assert report["verdicts"][0].startswith(verdict), report["verdicts"]
    assert "doctor_worker.py:" in report["verdicts"][0] and "in step" in report["verdicts"][0]
    rec = report["records"]["1"]  # from the store: node 0's folder has only rank 0's
    assert rec["node_rank"] == 1 and rec["reason"] == {"exit0": "exit", "hang": "stalled"}[mode]
    rows = {r["rank"]: r for r in report["rows"]}
    assert rows[0]["waiting_in"] == "all_reduce #14 on dp" and rows[0]["seq"] == 14
    assert rows[1]["last_completed"] == "all_reduce #13 on dp"
    if mode == "hang":
        assert "time.sleep" in (rec["stack"] or "")  # the remote rank's stack, via the store
