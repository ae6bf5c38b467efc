"""Stragglers: which rank a collective waited for, and for how long, named in the step log.

A rank that stops for a while (its node swapping, a SIGSTOP, a noisy neighbour, a slow
disk) is not a fault: training goes on once it catches up. Without a name, though, the
user sees only slow steps and cannot tell which node to look at. So while a collective
has been in flight on this rank for longer than :func:`threshold` (two heartbeat
intervals, at least 1 s), the heartbeat thread reads the heartbeats of the group's other
ranks once (:mod:`meshtrain.distributed.heartbeat`: one store ``get`` each, and only for
collectives that slow) and notes the ranks its evidence shows behind:

* the rank's heartbeat says it has not entered this collective yet (its count for the
  group is lower), or
* its heartbeat is older than the threshold: it went silent (stopped inside the
  collective, or before it could say it entered).

When the collective then completes, the wait (from this rank's entry to completion) and
the late ranks become one event; the engine takes the step's events when the step ends
(:meth:`Stragglers.take`), puts them in the step's facts (``last["stragglers"]``) and
logs one line per event, on every step that has one (not only every
``steps_per_print``). The logging rank logs them; another rank logs an event only when
the rank it waited for is the logging rank, which cannot know that it was the late one.

Evidence only: no heartbeat read (no TCP store, the store unreachable) names nobody, and
a rank is never named for a wait its heartbeat does not show.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

MIN_WAIT_S = 1.0


def threshold(beat_every_s: float) -> float:
    """Seconds a collective waits before its peers' heartbeats are read: two beat
    intervals, so a peer that entered has had time to say so, and at least 1 s."""
    return max(MIN_WAIT_S, 2 * beat_every_s)


class Stragglers:
    """This rank's slow collectives and the ranks they waited for (module doc)."""

    def __init__(self, rank: int, after_s: float) -> None:
        self.rank = rank
        self.after_s = after_s
        self._lock = threading.Lock()
        # (group, seq) -> (op, entered at, the late ranks) for slow collectives in flight
        self._looked: dict[tuple[Any, int], tuple[str, float, list[dict]]] = {}
        self._events: list[dict] = []

    def look(
        self,
        in_flight: list[tuple[Any, int, str, float]],
        read_beats: Callable[[list[int]], dict[int, dict]],
    ) -> None:
        """From the heartbeat thread: for each collective ``(group, seq, op, entered at)``
        in flight past the threshold and not looked at yet, read its group's heartbeats
        and keep the ranks that are behind."""
        now_mono, now = time.monotonic(), time.time()
        for group, seq, op, entered in in_flight:
            if now_mono - entered < self.after_s or (group, seq) in self._looked:
                continue
            beats = read_beats([r for r in group.ranks if r != self.rank])
            late = [
                behind
                for rank, beat in sorted(beats.items())
                if (behind := _behind(beat, group, seq, now, self.after_s)) is not None
            ]
            with self._lock:
                self._looked[(group, seq)] = (op, entered, late)

    def completed(self, group: Any, seq: int) -> None:
        """From the ledger, when ``seq`` on ``group`` completed on this rank."""
        if not self._looked:
            return
        with self._lock:
            looked = self._looked.pop((group, seq), None)
        if looked is None:
            return
        op, entered, late = looked
        if late:
            self._events.append(
                {
                    "group": group.name,
                    "op": op,
                    "seq": seq,
                    "waited_s": round(time.monotonic() - entered, 3),
                    "late": late,
                }
            )

    def take(self) -> list[dict]:
        """The events since the last call (the engine's step end)."""
        with self._lock:
            events, self._events = self._events, []
        return events


def _behind(beat: dict, group: Any, seq: int, now: float, after_s: float) -> dict | None:
    """``{"rank", "node", "address", "why"}`` when ``beat`` shows its rank behind in
    collective ``seq`` of ``group``, else None."""
    entered = next(
        (
            g["entered"]
            for g in beat.get("groups", [])
            if g["group"] == group.name and list(g["ranks"]) == list(group.ranks)
        ),
        0,
    )
    silent = now - beat.get("time", now)
    if entered < seq:
        why = f"had not entered it after {after_s:.1f} s"
    elif silent > after_s:
        why = f"was silent for {silent:.1f} s"
    else:
        return None
    return {
        "rank": beat["rank"],
        "node": beat.get("node_rank"),
        "address": beat.get("address"),
        "why": why,
    }


def describe(step: int, event: dict) -> str:
    """The step log's line for one event."""
    who = "; ".join(
        f"rank {r['rank']} (node {r['node']}, {r['address']}), which {r['why']}"
        for r in event["late"]
    )
    return (
        f"step {step}: straggler: waited {event['waited_s']:.1f} s in {event['op']} "
        f"#{event['seq']} on the {event['group']} group for {who}"
    )


__all__ = ["Stragglers", "describe", "threshold"]
