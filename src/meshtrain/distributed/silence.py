"""What is true of a rank that went silent: the verdicts on ranks without a record.

When the network between nodes fails, the record of a rank on the far side never reaches
the node that reports. Nothing then says whether that rank entered the collective its
peers waited in, so the verdict never claims it did not; it says what is known: the node
and address the rank had (its heartbeat, :mod:`meshtrain.distributed.heartbeat`), when it
was last heard and what it had entered by then, which collective the others waited in and
for how long; and, when the rendezvous store itself cannot be reached, that the master
node stopped answering -- or that this node's own link is down.

Two users: the ledger (a rank's own line when its collective failed,
:func:`explain_failure`) and the doctor (the launcher's report, :func:`silent_verdict`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshtrain.distributed.heartbeat import link_down, read_peers


@dataclass
class Evidence:
    """What a node knows beyond the ranks' records: every rank's last heartbeat (from the
    store, else this node's ``peers.json``), whether the store answered, this node."""

    beats: dict[int, dict] = field(default_factory=dict)
    store: tuple | None = None  # (host, port) of the rendezvous store
    store_answered: bool | None = None  # None: not asked (no store known)
    node_rank: int | None = None  # the reporting node
    link_down: str | None = None  # this node's cluster interface, when its link is down


def where(rank: int, evidence: Evidence) -> str:
    beat = evidence.beats.get(rank)
    if not beat:
        return ""
    return f" (node {beat.get('node_rank')}, {beat.get('address')})"


def silent_verdict(
    member: int,
    waiters: list[int],
    collective: str,
    records: Mapping[int, dict],
    exits: Mapping[int, str],
    evidence: Evidence,
    group: tuple,
) -> str:
    """The verdict on a member with no record: what is known, and only that."""
    names = ", ".join(f"rank {w}" for w in waiters) or "its peers"
    waited = f"{names} waited in {collective}"
    failed = [records[w] for w in waiters if w in records]
    if failed and any("timed out" in (r.get("error") or "").lower() for r in failed):
        waited += f" until the {failed[0].get('timeout_s') or '?'} s collective timeout"
    if member in exits:  # this node's launcher saw it end
        return f"rank {member}{where(member, evidence)} {exits[member]} while {waited}"
    here = "this node" if evidence.node_rank is None else f"node {evidence.node_rank}"
    heard = ""
    beat = evidence.beats.get(member)
    fresh = beat and not beat.get("kept")
    if fresh and failed and beat.get("attempt", 0) == failed[0].get("attempt", 0):
        gname, granks, top = group
        entered = next(
            (g["entered"] for g in beat.get("groups", [])
             if g["group"] == gname and g["ranks"] == granks), 0,
        )  # fmt: skip
        age = max(failed[0].get("time", 0) - beat.get("time", 0), 0.0)
        had = f"it had entered #{top} too" if entered >= top else f"it was at #{entered}"
        heard = f"; last heard {age:.1f} s before the failure, when {had}"
    return (
        f"rank {member}{where(member, evidence)} stopped answering: no record of it "
        f"reached {here}{heard}; {waited}"
    )


def store_lost_verdict(evidence: Evidence, silent: list[int]) -> str:
    here = "this node" if evidence.node_rank is None else f"node {evidence.node_rank}"
    if evidence.link_down:
        return (
            f"{here}'s own network link {evidence.link_down} is down: it cannot reach the "
            f"rendezvous store ({evidence.store[0]}:{evidence.store[1]}) nor the other nodes"
        )
    ranks = ", ".join(f"rank {r}{where(r, evidence)}" for r in silent)
    host, port = evidence.store or ("?", "?")
    return (
        f"the master node {host} stopped answering {here}: its rendezvous store "
        f"({host}:{port}) cannot be reached, so nothing is known of {ranks}"
    )


def _not_entered(
    what: str, failed: tuple[str, list[int], int, str], others: list[int], heard: dict, now: float
) -> str | None:
    """A timeout while every peer still beat: the peers that had not entered the collective
    are alive but elsewhere (a slow first step, a longer data load, a different code path).
    The backend's "Timed out waiting 6000ms for recv" says none of that. Name them with
    how far they had come on this group, or None when all of them had entered too."""
    gname, granks, seq, _ = failed
    late = []
    for r in others:
        entered = _entered(heard[r], gname, granks)
        if entered < seq:
            b = heard[r]
            late.append(
                f"rank {r} (node {b.get('node_rank')}, {b.get('address')}; alive, heard "
                f"{now - b['time']:.1f} s ago, then at #{entered})"
            )
    if not late:
        return None
    verb = "has" if len(late) == 1 else "have"
    return f"{what}: {', '.join(late)} {verb} not entered it"


def _entered(beat: dict, gname: str, granks: list[int]) -> int:
    """How many collectives of this group a rank had entered, per its heartbeat."""
    return next(
        (g["entered"] for g in beat.get("groups", [])
         if g["group"] == gname and g["ranks"] == list(granks)), 0,
    )  # fmt: skip


def _closed_by_peer(what: str, first: str, others: list[int], heard: dict, now: float):
    """gloo's "Connection closed by peer [ADDRESS]:PORT" while every peer still beat: a
    process at that address ended (killed, or crashed) before its heartbeat could go
    stale. Name the ranks that beat from that address, or None when none did."""
    m = re.search(r"[Cc]onnection closed by peer \[([^\]]+)\]", first)
    if m is None:
        return None
    addr = m.group(1)
    gone = [r for r in others if heard.get(r, {}).get("address") == addr]
    if not gone:
        return None
    names = ", ".join(
        f"rank {r} (node {heard[r].get('node_rank')}, {addr}; last heard "
        f"{now - heard[r]['time']:.1f} s ago)"
        for r in gone
    )
    return f"{what}: {names} closed the connection: its process ended (killed or crashed)"


def explain_failure(
    failed: tuple[str, list[int], int, str],
    error: str | None,
    timeout_s: float | None,
    rank: int,
    world: int,
    address: str | None,
    beats: Any,
) -> str | None:
    """One line on why this rank's failed collective failed, when a peer went silent.

    ``failed`` is (group name, its ranks, the collective's number, its op); ``beats`` the
    rank's :class:`~meshtrain.distributed.heartbeat.Heartbeat`. Members of the group whose
    heartbeat stopped (or never came) are named with their node, address and when they
    were last heard, and whether they had entered this collective by then. When the store
    itself cannot be reached, the master node is what stopped answering (or this node's
    own link is down). None when every peer still beats (not a network matter: the
    traceback is the story) or nothing is known.
    """
    if beats is None:
        return None
    gname, granks, seq, op = failed
    first = (error or "").splitlines()[0] if error else ""
    timed_out = "timed out" in first.lower() or "timeout" in first.lower()
    closed = re.search(r"[Cc]onnection closed by peer \[([^\]]+)\]", first)
    brief = f"connection closed by {closed.group(1)}" if closed else first[:120]
    what = f"{op} #{seq} on the {gname} group " + (
        f"timed out after {timeout_s:g} s" if timed_out and timeout_s else f"failed ({brief})"
    )
    others = [r for r in granks if r != rank]
    node = _node_rank()
    heard = beats.read(world)
    if heard is None:
        down = link_down()
        if down:
            return (
                f"{what}: this node's network link {down} is down (node {node}, "
                f"{address}): it cannot reach the other nodes"
            )
        host, port = beats.store_address or ("?", "?")
        peers = read_peers()
        away = [r for r in others if peers.get(r, {}).get("node_rank") != node]
        with_it = f"; unreachable with it: {_ranks_text(away, peers)}" if away else ""
        return (
            f"{what}: the master node {host} (its rendezvous store, port {port}) stopped "
            f"answering node {node}{with_it}"
        )
    now = time.time()
    silent = [r for r in others if r not in heard or now - heard[r]["time"] > 3 * beats.every]
    if not silent:
        closed = _closed_by_peer(what, first, others, heard, now)
        return closed or (timed_out and _not_entered(what, failed, others, heard, now)) or None
    parts = []
    for r in silent:
        b = heard.get(r)
        if b is None:
            parts.append(f"rank {r} (never heard from)")
            continue
        entered = _entered(b, gname, granks)
        had = f"it had entered #{seq} too" if entered >= seq else f"then at #{entered}"
        parts.append(
            f"rank {r} (node {b.get('node_rank')}, {b.get('address')}; last heard "
            f"{now - b['time']:.1f} s ago, {had})"
        )
    return f"{what}: {', '.join(parts)} stopped answering"


def _node_rank() -> int | None:
    import os

    value = os.environ.get("GROUP_RANK", "")
    return int(value) if value.isdigit() else None


def _ranks_text(ranks: list[int], peers: dict[int, dict]) -> str:
    return ", ".join(
        f"rank {r} (node {peers[r].get('node_rank')}, {peers[r].get('address')})"
        if r in peers else f"rank {r}"
        for r in ranks
    )  # fmt: skip
