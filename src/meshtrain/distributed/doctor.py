"""The hang doctor: from every rank's ledger record to one table and a verdict.

Input: the records :mod:`meshtrain.distributed.ledger` publishes (one per rank, from the
rendezvous store, which holds every node's, else from this node's doctor folder:
:func:`read_job`) and what the launcher knows about each process
(exit code, or "stopped"). Output: a :class:`Report` -- one row per rank (last completed
collective, the one it is waiting in, its sequence number, its state) and verdicts, e.g.::

    rank 1 never entered all_reduce #14 on the dp group (last seen at train.py:31 in step)
    ranks disagree at #14 on the dp group: rank 0 all_reduce [4096] float32, rank 1 all_gather [2048] float32
    rank 1 raised ValueError: bad batch (outside any collective); its peers then failed in all_reduce #3 on the dp group

How: collectives on one group are numbered on every member in the same order, so

1. a desync is two ranks whose entries with the same group and number differ in op,
   shapes or dtype (the lowest such number is reported);
2. a missing rank is a member whose last number on a group is below the group's highest:
   it never entered that collective; where it was instead comes from its stack (a stall
   report), its own exception, or its last ledger entry;
3. a rank that raised outside any collective, or left the job (``sys.exit``) while its
   peers waited, is the culprit even when the launcher saw another rank fail first.

The culprit (first verdict's rank) is what ``meshtrain launch`` blames, with its exit code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshtrain.distributed.rank_records import read_store
from meshtrain.distributed.silence import Evidence, silent_verdict, store_lost_verdict

_PACKAGE_DIRS = (
    os.sep + os.path.join("meshtrain", "distributed") + os.sep,
    os.sep + "torch" + os.sep,
    os.sep + "threading.py",
)


@dataclass
class Row:
    """One rank's line of the table."""

    rank: int
    state: str  # "waiting", "stalled", "raised", "exited", "no report", ...
    last_completed: str = "-"
    waiting_in: str = "-"
    seq: int | None = None
    note: str = ""


@dataclass
class Report:
    """The doctor's findings: a row per rank, verdicts (first is the culprit)."""

    rows: list[Row]
    verdicts: list[str]
    culprit: int | None = None
    records: dict[int, dict] = field(default_factory=dict)

    def table(self) -> str:
        """The table the launcher prints (plain text, one line per rank)."""
        head = ("rank", "state", "last completed", "waiting in", "seq #", "note")
        body = [
            (
                str(r.rank),
                r.state,
                r.last_completed,
                r.waiting_in,
                "-" if r.seq is None else str(r.seq),
                r.note,
            )
            for r in self.rows
        ]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(5)]
        lines = ["meshtrain doctor: the collectives of every rank when the job stopped"]
        for cells in [head, *body]:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(cells[:5], widths, strict=True))
                + "  "
                + cells[5]
            )
        lines += [f"verdict: {v}" for v in self.verdicts] or ["verdict: no rank looks stuck"]
        return "\n".join(line.rstrip() for line in lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdicts": self.verdicts,
            "culprit": self.culprit,
            "rows": [asdict(r) for r in self.rows],
            "records": {str(k): v for k, v in sorted(self.records.items())},
        }

    def write(self, folder: str | os.PathLike) -> Path:
        """Write ``doctor.json`` into ``folder``; return its path."""
        path = Path(folder) / "doctor.json"
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


def read_folder(folder: str | os.PathLike) -> tuple[dict[int, dict], dict[int, int]]:
    """The records (``rank<R>.json``) and pids (``hello<R>.json``) in a doctor folder.

    Only the newest elastic attempt's records are kept.
    """
    records, hellos = _read_folder(folder)
    return _newest_attempt(records), {r: int(h["pid"]) for r, h in hellos.items()}


def _read_folder(folder: str | os.PathLike) -> tuple[dict[int, dict], dict[int, dict]]:
    records: dict[int, dict] = {}
    hellos: dict[int, dict] = {}
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if path.name.startswith("hello"):
            hellos[int(data["rank"])] = data
        elif path.name.startswith("rank"):
            records[int(data["rank"])] = data
    return records, hellos


def _newest_attempt(records: dict[int, dict]) -> dict[int, dict]:
    if not records:
        return records
    newest = max(r.get("attempt", 0) for r in records.values())
    return {k: v for k, v in records.items() if v.get("attempt", 0) == newest}


def read_evidence(
    folder: str | os.PathLike, world_size: int = 0, deadline_s: float = 5.0
) -> tuple[dict[int, dict], dict[int, int], int, Evidence]:
    """:func:`read_job` plus the :class:`Evidence` (heartbeats, the store's answer)."""
    from meshtrain.distributed.heartbeat import link_down, read_peers

    records, hellos = _read_folder(folder)
    world = max(
        [world_size, *(int(x.get("world_size", 0)) for x in [*records.values(), *hellos.values()])]
    )
    evidence = Evidence(link_down=link_down())
    nodes = [h.get("node_rank") for h in hellos.values() if h.get("node_rank") is not None]
    evidence.node_rank = nodes[0] if nodes else None
    addresses = [tuple(h["store"]) for h in hellos.values() if h.get("store")]
    if addresses and world:
        evidence.store = addresses[0]
        found = _read_remote_store(addresses[0], world, deadline_s)
        evidence.store_answered = found is not None
        remote, evidence.beats = found or ({}, {})
        for rank, rec in remote.items():
            mine = records.get(rank)
            if mine is None or rec.get("time", 0) > mine.get("time", 0):
                records[rank] = rec
    for rank, beat in read_peers(str(folder)).items():
        # the first beats, kept on this node: where each rank is, not when it was last heard
        evidence.beats.setdefault(rank, {**beat, "kept": True})
    for rank, rec in list(records.items()):
        beat = evidence.beats.get(rank)
        if rec.get("reason") == "stalled" and beat and not beat.get("kept"):
            # a stall report (a slow import, a long first step) that the rank outlived:
            # its later heartbeat shows collectives past it, so it says nothing of now
            past = max((g["entered"] for g in rec.get("groups", [])), default=0)
            now = max((g["entered"] for g in beat.get("groups", [])), default=0)
            if beat.get("time", 0) > rec.get("time", 0) and now > past:
                del records[rank]
    world = max([world, *(int(r.get("world_size", 0)) for r in records.values())])
    pids = {r: int(h["pid"]) for r, h in hellos.items()}
    return _newest_attempt(records), pids, world, evidence


def read_job(
    folder: str | os.PathLike, world_size: int = 0, deadline_s: float = 5.0
) -> tuple[dict[int, dict], dict[int, int], int]:
    """Every rank's record, the other nodes' included: ``(records, local pids, world)``.

    The rendezvous store (its address from this node's ``hello<R>.json``) holds the
    records of all ranks on all nodes; the doctor folder holds this node's, and is the
    fallback when the store cannot be reached (its host, node 0's agent, is gone). Per
    rank the newer of the two wins (a folder-only record: one written after the store's
    deadline). The store is read on a helper thread within ``deadline_s``.
    """
    records, pids, world, _evidence = read_evidence(folder, world_size, deadline_s)
    return records, pids, world


def _read_remote_store(
    address: tuple, world: int, deadline_s: float
) -> tuple[dict[int, dict], dict[int, dict]] | None:
    """``(records, heartbeats)`` from a fresh client of the TCP store at ``address``
    (host, port); None when it does not answer.

    A plain socket is tried first, with the deadline: a store client's constructor
    retries for its whole timeout in C++, and a thread left inside it when this process
    exits aborts the process ("terminate called without an active exception")."""
    import socket
    import threading
    from datetime import timedelta

    from meshtrain.distributed.rank_records import read_beats

    host, port = address
    try:
        socket.create_connection((host, int(port)), timeout=min(deadline_s, 3.0)).close()
    except OSError:
        return None
    found: dict[int, dict] = {}
    beats: dict[int, dict] = {}
    answered = threading.Event()

    def read() -> None:
        try:
            from torch.distributed import TCPStore

            client = TCPStore(
                host,
                int(port),
                is_master=False,
                timeout=timedelta(seconds=deadline_s),
                wait_for_workers=False,
            )
            found.update(read_store(client, world))
            beats.update(read_beats(client, world))
            answered.set()
        except Exception:  # noqa: BLE001 - store gone: the folder is what there is
            pass

    t = threading.Thread(target=read, name="meshtrain-doctor-read", daemon=True)
    t.start()
    t.join(deadline_s + 1.0)
    return (dict(found), dict(beats)) if answered.is_set() else None


def _entry_text(e: Mapping) -> str:
    return f"{e['op']} #{e['seq']} on {e['group']}"


def _shape_text(e: Mapping) -> str:
    shapes = ", ".join(str(list(s)) for s in e["shapes"])
    return f"{e['op']} {shapes} {e['dtype']}"


def _last_seen(rec: Mapping) -> str:
    """Where a rank was: its innermost user frame from the stack, else its last entry."""
    stack = rec.get("stack") or ""
    frames = [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]
    for frame in reversed(frames):
        if not any(p in frame for p in _PACKAGE_DIRS):
            # 'File "x.py", line 12, in f' -> x.py:12 in f
            parts = frame.split('"')
            if len(parts) >= 3:
                rest = parts[2].strip(", ").replace("line ", "").split(", in ")
                if len(rest) == 2:
                    return f"{parts[1]}:{rest[0]} in {rest[1]}"
            return frame
    entries = rec.get("entries") or []
    if entries:
        e = entries[-1]
        return f"{e['where']} in {e['function']} (after {_entry_text(e)})"
    return "before its first collective"


def diagnose(
    records: Mapping[int, dict],
    world_size: int,
    exits: Mapping[int, str] | None = None,
    evidence: Evidence | None = None,
) -> Report:
    """Build the table and verdicts from per-rank records (see module docstring).

    ``exits`` maps a rank to what the launcher saw happen to it ("exited with code 3",
    "was killed by SIGKILL", "stopped (SIGSTOP)", ...). ``evidence`` (heartbeats, whether
    the store answered) lets a rank with no record be named by node and address.
    """
    exits = dict(exits or {})
    evidence = evidence or Evidence()
    verdicts: list[tuple[int | None, str]] = []

    # every (group, ranks) -> {rank: last seq entered}, and the entries by number
    entered: dict[tuple, dict[int, int]] = {}
    by_seq: dict[tuple, dict[int, dict]] = {}
    for rank, rec in records.items():
        for g in rec.get("groups", []):
            entered.setdefault((g["group"], tuple(g["ranks"])), {})[rank] = g["entered"]
        for e in rec.get("entries", []):
            by_seq.setdefault((e["group"], tuple(e["ranks"]), e["seq"]), {})[rank] = e

    # 1. desync: same group and number, different collective
    for (gname, _ranks, seq), per_rank in sorted(by_seq.items(), key=lambda kv: kv[0][2]):
        kinds = {(e["op"], str(e["shapes"]), e["dtype"]) for e in per_rank.values()}
        if len(kinds) > 1:
            parts = ", ".join(f"rank {r} {_shape_text(e)}" for r, e in sorted(per_rank.items()))
            first = min(per_rank)
            verdicts.append((first, f"ranks disagree at #{seq} on the {gname} group: {parts}"))
            break

    # 3. a rank that raised outside a collective, or left, before its peers failed
    failures = [
        (rec.get("time", 0), rank, rec)
        for rank, rec in records.items()
        if rec.get("reason") in ("exception", "exit")
    ]
    for _t, rank, rec in sorted(failures, key=lambda x: x[0]):
        how = exits.get(rank)
        if rec["reason"] == "exception":
            verdicts.append(
                (
                    rank,
                    f"rank {rank} raised {rec.get('error')} (outside any collective, at "
                    f"{_last_seen(rec)})",
                )  # fmt: skip
            )
        elif how is not None or any(
            entered.get(k, {}).get(rank, 0) < max(v.values()) for k, v in entered.items()
        ):
            verdicts.append(
                (
                    rank,
                    f"rank {rank} left the job ({how or 'its process ended'}) at "
                    f"{_last_seen(rec)} while its peers still needed it",
                )  # fmt: skip
            )

    # 2. members that never entered the group's newest collective
    for (gname, granks), seqs in sorted(entered.items()):
        top = max(seqs.values())
        leader = next(r for r, s in sorted(seqs.items()) if s == top)
        op = by_seq.get((gname, granks, top), {}).get(leader, {}).get("op", "collective")
        waiters = [r for r, s in sorted(seqs.items()) if s >= top]
        for member in granks:
            if member in seqs and seqs[member] >= top:
                continue
            rec = records.get(member)
            if rec is None:
                # no record: nothing says whether it entered (never claim it did not)
                verdicts.append(
                    (member, silent_verdict(member, waiters, f"{op} #{top} on the {gname} group",
                                     records, exits, evidence, (gname, list(granks), top)))
                )  # fmt: skip
                continue
            where = f"last seen at {_last_seen(rec)}"
            verdicts.append(
                (member, f"rank {member} never entered {op} #{top} on the {gname} group ({where})")
            )
    if evidence.store_answered is False and any(r not in records for r in range(world_size)):
        # this node lost the store's node: that is the first thing to say
        silent = [r for r in range(world_size) if r not in records]
        verdicts.insert(0, (silent[0], store_lost_verdict(evidence, silent)))

    rows = []
    for rank in range(world_size):
        rec = records.get(rank)
        if rec is None:
            rows.append(Row(rank, exits.get(rank, "no report"), note="published nothing"))
            continue
        entries = rec.get("entries") or []
        done = [e for e in entries if e["done"]]
        pending = [e for e in entries if not e["done"]]
        state = {
            "error": "failed in collective",
            "stalled": "stalled",
            "exception": "raised",
            "exit": "exited",
        }.get(rec.get("reason"), rec.get("reason", "?"))
        note = rec.get("error") or ""
        if rank in exits:
            note = f"{exits[rank]}; {note}" if note else exits[rank]
        if rec.get("reason") == "stalled" and not pending:
            note = (note + "; " if note else "") + f"in Python at {_last_seen(rec)}"
        waiting = pending[-1] if pending else None
        rows.append(
            Row(
                rank,
                state,
                last_completed=_entry_text(done[-1]) if done else "-",
                waiting_in=_entry_text(waiting) if waiting else "-",
                seq=waiting["seq"] if waiting else (done[-1]["seq"] if done else None),
                note=note[:160],
            )
        )

    seen: set[str] = set()
    unique = [(r, v) for r, v in verdicts if not (v in seen or seen.add(v))]
    culprit = unique[0][0] if unique else None
    return Report(rows, [v for _r, v in unique], culprit, dict(records))
