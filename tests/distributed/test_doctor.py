"""The hang doctor end to end: ``meshtrain launch`` of 2 ranks that go wrong on purpose.

Each case launches ``doctor_worker.py`` (collective timeout 6 s) and asserts that the
launcher's table and ``doctor.json`` name the right rank, op and sequence number, that the
job's exit code and blame are the culprit's, and that every process is gone within the
timeout plus a margin (the subprocess deadline below: generous, because on a shared 2-core
machine with a load of 15 one launch took 60 s -- three Python processes importing torch,
the 6 s collective timeout, a 3 s exit barrier and the agent's wait of up to 10 s for
survivors to leave on their own; it only bounds a hang, nothing asserts the time).
The pure verdict logic is tested without processes at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtrain.distributed.doctor import Evidence, diagnose
from tests.launch import REPO, run_launch

WORKER = REPO / "tests" / "distributed" / "doctor_worker.py"
DEADLINE_S = 240


def _launch(mode: str, run_dir: Path):
    # the raise case at torchrun's own 0.1 s poll: rank 0's one line naming rank 1 must
    # not depend on the poll's phase (meshtrain.launch.agent waits for it to leave)
    poll = ["--monitor_interval", "0.1"] if mode == "raise" else []
    argv = ["--nproc_per_node", "2", *poll, str(WORKER), mode, str(run_dir)]
    out = run_launch(*argv, timeout=DEADLINE_S)
    report = json.loads((run_dir / "doctor.json").read_text())
    return out, report


@pytest.mark.parametrize(
    "mode, code, verdict",
    [
        ("hang", None, "rank 1 never entered all_reduce #14 on the dp group (last seen at "),
        ("raise", 1, "rank 1 raised ValueError: bad batch at step 14"),
        ("exit3", 3, "rank 1 left the job (exited with code 3)"),
        # to torch's agent a rank that exits 0 succeeded; blaming rank 0's "Connection
        # closed by peer" was wrong, and 0 is no exit code for a failed job
        ("exit0", 1, "rank 1 left the job (exited with code 0)"),
        (
            "desync",
            None,
            "ranks disagree at #14 on the dp group: rank 0 all_reduce [4096] float32, "
            "rank 1 all_gather [4096] float32",
        ),
    ],
)
def test_doctor_names_rank_op_and_sequence(tmp_path: Path, mode: str, code, verdict: str):
    out, report = _launch(mode, tmp_path)
    assert out.returncode != 0
    if code is not None:
        assert out.returncode == code, out.stderr[-3000:]
    assert report["verdicts"][0].startswith(verdict), report["verdicts"]
    assert f"verdict: {verdict}" in out.stderr
    assert "meshtrain doctor: the collectives of every rank" in out.stderr
    rows = {r["rank"]: r for r in report["rows"]}
    # rank 0 waits in all_reduce #14 (or failed there); rank 1 completed #13
    assert rows[0]["waiting_in"] == "all_reduce #14 on dp" and rows[0]["seq"] == 14
    assert rows[1]["last_completed"] == "all_reduce #13 on dp"
    if mode == "hang":
        assert report["culprit"] == 1
        assert "doctor_worker.py:" in report["verdicts"][0] and "in step" in report["verdicts"][0]
        assert "time.sleep" in (report["records"]["1"]["stack"] or "")  # its stack was dumped
        assert "failed: rank 1" in out.stderr  # blamed, not rank 0 whose collective timed out
    if mode == "raise":
        # the real traceback once, first; rank 0's collateral error is one line
        assert out.stderr.count("ValueError: bad batch at step 14") >= 1
        first_tb = out.stderr.index("Traceback")
        assert "[rank1]" in out.stderr[first_tb - 10 : first_tb]
        assert "because rank 1 raised first: ValueError: bad batch at step 14" in out.stderr
        assert "[rank0]: Traceback" not in out.stderr
    if mode == "exit3":
        assert "because rank 1 left the job first" in out.stderr
        assert "[rank0]: Traceback" not in out.stderr
    if mode == "desync":
        assert rows[1]["waiting_in"] == "all_gather #14 on dp"
    if mode == "exit0":
        assert report["culprit"] == 1
        assert (
            "failed: rank 1 (local rank 1) left the job early (exited with code 0) while its "
            "peers still needed it; also failed: rank 0 (exited with code 1)" in out.stderr
        )
        # rank 0's collateral "Connection closed by peer" is one line naming rank 1
        assert "because rank 1 left the job first" in out.stderr
        assert "[rank0]: Traceback" not in out.stderr


def _rec(rank, reason, seqs, pending=None, error=None, stack=None, t=0.0):
    entries = [
        {
            "group": "dp", "ranks": [0, 1], "seq": s, "op": "all_reduce", "shapes": [[8]],
            "dtype": "float32", "where": "train.py:10", "function": "step", "done": True,
        }
        for s in range(1, seqs + 1)
    ]  # fmt: skip
    if pending:
        entries.append({**entries[-1], "seq": seqs + 1, "op": pending, "done": False})
    entered = seqs + (1 if pending else 0)
    return {
        "rank": rank, "world_size": 2, "reason": reason, "error": error, "stack": stack,
        "time": t, "entries": entries,
        "groups": [{"group": "dp", "ranks": [0, 1], "entered": entered, "done": seqs}],
    }  # fmt: skip


def test_verdicts_without_processes():
    stack = '  File "train.py", line 40, in main\n    step()\n  File "model.py", line 7, in fwd\n'
    records = {
        0: _rec(0, "error", 13, "all_reduce", "timeout"),
        1: _rec(1, "stalled", 13, stack=stack),
    }
    rep = diagnose(records, 2)
    assert rep.verdicts == [
        "rank 1 never entered all_reduce #14 on the dp group (last seen at model.py:7 in fwd)"
    ]
    assert rep.culprit == 1
    # no report from a killed rank: the launcher's words are used, and no claim that it
    # "never entered" (without its record nothing says whether it did: issue 47)
    rep = diagnose({0: records[0]}, 2, {1: "was killed by SIGKILL"})
    assert rep.verdicts == [
        "rank 1 was killed by SIGKILL while rank 0 waited in all_reduce #14 on the dp group"
    ]
    assert "published nothing" in rep.table()
    # no report and no launcher's word (another node): what its heartbeat said, and only that
    evidence = Evidence(
        beats={1: {"node_rank": 1, "address": "10.9.0.2", "time": 999.0, "attempt": 0,
                   "groups": [{"group": "dp", "ranks": [0, 1], "entered": 14, "done": 13}]}},
        store_answered=True, node_rank=0,
    )  # fmt: skip
    rep = diagnose({0: {**records[0], "time": 1002.5}}, 2, {}, evidence)
    assert rep.culprit == 1 and rep.verdicts == [
        "rank 1 (node 1, 10.9.0.2) stopped answering: no record of it reached node 0; last "
        "heard 3.5 s before the failure, when it had entered #14 too; rank 0 waited in "
        "all_reduce #14 on the dp group"
    ]
    # the store's node lost: said first
    lost = Evidence(store=("10.9.0.1", 29500), store_answered=False, node_rank=1)
    rep = diagnose({0: records[0]}, 2, {}, lost)
    assert rep.verdicts[0] == (
        "the master node 10.9.0.1 stopped answering node 1: its rendezvous store "
        "(10.9.0.1:29500) cannot be reached, so nothing is known of rank 1"
    )
    # three groups in flight but agreeing: nobody is blamed
    rep = diagnose({0: _rec(0, "exit", 5), 1: _rec(1, "exit", 5)}, 2)
    assert rep.verdicts == [] and rep.culprit is None and "no rank looks stuck" in rep.table()


def _rank1_skips_third_all_reduce() -> None:
    import time

    import torch
    import torch.distributed as dist

    from meshtrain.distributed import comm
    from meshtrain.distributed.topology import Topology

    topo = Topology()
    t = torch.ones(8)
    for i in range(1, 4):
        if dist.get_rank() == 1 and i == 3:
            time.sleep(30)  # stuck in Python; rank 0 times out in all_reduce #3
        comm.all_reduce(t, topo.dp_group)


def test_notebook_launcher_failure_carries_the_doctors_table():
    from meshtrain.launch.processes import RankFailedError, run_on_ranks

    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_rank1_skips_third_all_reduce, 2, timeout=120, collective_timeout_minutes=0.1)
    msg = str(info.value)
    assert "rank 0 raised" in msg and "meshtrain doctor:" in msg
    assert "verdict: rank 1 never entered all_reduce #3 on the dp group (last seen at" in msg
    assert "test_doctor.py:" in msg  # rank 1's stall report points at the sleep
