"""Bytes and call counts of the collectives one ``Topology`` ran, by (op, group name).

``meshtrain.distributed.comm`` records into it; its module docstring gives the byte
convention. The topology's collective ``ledger`` (what the hang doctor reads) rides along
here so that every ``Group`` reaches both through one object.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from meshtrain.distributed.ledger import Ledger


class CommStats:
    """Bytes and call counts by (op, group name), owned by one ``Topology``.

    Thread-safe: gradient hooks may record from autograd's worker threads on GPU. Also holds
    the topology's collective ``ledger`` (:mod:`meshtrain.distributed.ledger`), which the
    hang doctor reads; it does not take part in the byte accounting.
    """

    def __init__(self) -> None:
        self.ledger = Ledger()
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self._wire: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, op: str, group: str, nbytes: int, group_size: int) -> None:
        with self._lock:
            key = (op, group)
            self._bytes[key] += nbytes
            self._calls[key] += 1
            # send/recv/broadcast move the whole payload; collectives the ring fraction
            factor = 1.0 if op in ("send", "recv", "broadcast") else (group_size - 1) / group_size
            self._wire[key] += nbytes * factor

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of bytes by (op, group) so far; subtract two with ``diff``."""
        with self._lock:
            return dict(self._bytes)

    @staticmethod
    def diff(after: dict, before: dict) -> dict[tuple[str, str], int]:
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}

    def total(self, *, op: str | None = None, group: str | None = None) -> int:
        """Recorded bytes, optionally only one op kind and/or one group name."""
        with self._lock:
            return sum(
                v
                for (o, g), v in self._bytes.items()
                if (op is None or o == op) and (group is None or g == group)
            )

    def calls(self, *, op: str | None = None, group: str | None = None) -> int:
        with self._lock:
            return sum(
                v
                for (o, g), v in self._calls.items()
                if (op is None or o == op) and (group is None or g == group)
            )

    def sent_by_group(self) -> dict[str, float]:
        """Bytes this rank sent so far by group name: ``wire_bytes`` without what it
        received (``recv``) and without control traffic (barriers, the hang doctor's
        exchanges). What a full-duplex link's time depends on."""
        out: dict[str, float] = defaultdict(float)
        with self._lock:
            for (o, g), v in self._wire.items():
                if o not in ("control", "recv"):
                    out[g] += v
        return dict(out)

    def wire_bytes(self) -> float:
        """Bytes a ring implementation sends per rank: recorded x (n-1)/n for collectives."""
        with self._lock:
            return sum(self._wire.values())

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (o, _g), v in self.snapshot().items():
            out[o] += v
        return dict(out)

    def by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_o, g), v in self.snapshot().items():
            out[g] += v
        return dict(out)

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._calls.clear()
            self._wire.clear()
