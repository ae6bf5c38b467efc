"""What ``meshtrain launch`` says when a job fails: the culprit, the exit code, the table.

torch's agent reports the *local* workers that failed and picks the first by the time
stamp of their error files; without error files that is a tie that goes to the lowest
rank. Both are often wrong about the cause:

* a rank that leaves early with ``sys.exit(0)`` is, to the agent, a success; its peer's
  collective then fails ("Connection closed by peer") and that peer gets the blame;
* a rank on *another node* is not in this agent's failures at all.

The hang doctor (:mod:`meshtrain.distributed.doctor`) reads every rank's ledger record --
from the rendezvous store, which holds the records of all nodes, else from this node's
doctor folder -- and names the culprit. The summary line and the exit code follow it:

* a culprit among this node's failures: its own exit code when it exited with one (a
  signal came from the agent's stop, so the first failure's code stays);
* a culprit that exited 0, or that runs on another node: the line names it (with its
  node, host and local rank from its record), the exit code stays the first local
  failure's (never 0: the job failed).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

_STATE = {
    "exit": "left the job early",
    "stalled": "stalled",
    "exception": "raised",
    "error": "failed in a collective",
}


def exit_code(code: int | None) -> int:
    """A process's return code as a shell would report it (signal N -> 128 + N)."""
    if code is None:
        return 1
    return 128 - code if code < 0 else code


def report_failure(exc, doctor_dir: str, stopped: Mapping[int, str]) -> tuple[int, bool]:
    """Print who failed (the doctor's culprit first) and the doctor's table.

    ``exc`` is torch's ``ChildFailedError``. Returns the job's exit code and whether the
    doctor folder holds the written report (then the caller keeps the folder).
    """
    from meshtrain.distributed.doctor import diagnose, read_evidence

    rank, failure = exc.get_first_failure()
    records, pids, world, evidence = read_evidence(doctor_dir)
    local = set(pids) | set(exc.failures)
    exits = {r: how(f) for r, f in exc.failures.items()}
    for r, rec in records.items():
        if r in pids and r not in exc.failures and rec.get("reason") == "exit":
            exits[r] = "exited with code 0"  # the agent counts it as a success
    exits.update(stopped)
    world = max([world, *(r + 1 for r in exc.failures)])
    report = diagnose(records, world, exits, evidence) if records else None
    code = exit_code(failure.exitcode)
    blame = f"rank {rank} (local rank {failure.local_rank}) {how(failure)}"
    culprit = None if report is None else report.culprit
    if culprit is not None and culprit != rank:
        if culprit in exc.failures:
            rank, failure = culprit, exc.failures[culprit]
            blame = f"rank {rank} (local rank {failure.local_rank}) {how(failure)}"
            if failure.exitcode > 0:  # its own code; a signal came from the agent's stop
                code = failure.exitcode
        else:
            rank, failure = culprit, None
            blame = _describe(culprit, records.get(culprit), exits.get(culprit), culprit in local)
            if culprit not in records and report.verdicts:
                blame = report.verdicts[0]  # no record to describe: what is known of it
    others = ", ".join(f"rank {r} ({how(f)})" for r, f in sorted(exc.failures.items()) if r != rank)
    print(
        f"meshtrain launch: {exc.name} failed: {blame}"
        + (f"; also failed: {others}" if others else ""),
        file=sys.stderr,
    )
    if failure is not None and failure.error_file and os.path.isfile(failure.error_file):
        # the worker used torch's @record: its error file holds the root cause
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        print(message, file=sys.stderr)
    if report is None:
        return code or 1, False
    mine = [records[r] for r in sorted(records) if r in local] + list(records.values())
    run_dirs = [r["run_dir"] for r in mine if r.get("run_dir")]
    target = run_dirs[0] if run_dirs and os.path.isdir(run_dirs[0]) else doctor_dir
    try:
        path = report.write(target)
    except OSError:
        path = report.write(doctor_dir)
    print(f"{report.table()}\nmeshtrain doctor: report written to {path}", file=sys.stderr)
    return code or 1, os.path.dirname(path) == doctor_dir


def _describe(rank: int, rec: dict | None, exited: str | None, is_local: bool) -> str:
    """``rank 1 (local rank 0 on node 1, host n2) left the job early ...`` from its record."""
    if rec is None:
        return f"rank {rank} ({exited or 'published no report'})"
    where = f"local rank {rec.get('local_rank', '?')}"
    if not is_local:
        where += f" on node {rec.get('node_rank', '?')}, host {rec.get('host', '?')}"
    what = _STATE.get(rec.get("reason"), rec.get("reason", "failed"))
    if rec.get("reason") == "exit":
        what += f" ({exited})" if exited else " (its own node's launcher has its exit code)"
        what += " while its peers still needed it"
    elif rec.get("reason") == "stalled":
        what += f" (no collective for {rec.get('idle_s', '?')} s)"
    elif rec.get("error"):
        what += f" {rec['error'].splitlines()[0][:160]}"
    return f"rank {rank} ({where}) {what}"


def how(failure) -> str:
    """What happened to a failed local worker, in words."""
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"
