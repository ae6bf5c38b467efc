"""Where each rank's ledger record lives in the rendezvous store, and reading them all.

The ledger (``ledger.py``) publishes a rank's record under ``meshtrain/doctor/rank<R>``;
the ledger (to learn why a collective failed: a peer's earlier record) and the doctor
(to report on the whole job) read them back. The key layout lives here, once, so the two
never import each other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

STORE_PREFIX = "meshtrain/doctor/"
DOCTOR_DIR_ENV = "MESHTRAIN_DOCTOR_DIR"  # this node's doctor folder (set by the launchers)
PEERS_FILE = "peers.json"  # every rank's first heartbeat, kept on each node (heartbeat.py)


ROUND_ENV = "MESHTRAIN_RDZV_ROUND"  # set for the workers by meshtrain's agent (launch/agent.py)


def attempt(environ: Mapping[str, str] = os.environ) -> int:
    """This start of the job's workers, numbered the same on every node.

    torch's ``TORCHELASTIC_RESTART_COUNT`` counts only a node's *own* failures: when node
    1's rank dies, node 1's agent restarts its workers as restart 1 while node 0's agent,
    which restarts its healthy workers for the new rendezvous round, still says 0 -- and
    store keys made from it never meet (node 1 waited 60 s for node 0's gloo address
    under ``attempt1``). meshtrain's agent exports the rendezvous round, which every node
    shares (``ROUND_ENV``); under another launcher the restart count is all there is.
    """
    for name in (ROUND_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def record_key(rank: int) -> str:
    """The store key of ``rank``'s record."""
    return f"{STORE_PREFIX}rank{rank}"


def read_store(store: Any, world_size: int, wait_s: float = 0.0) -> dict[int, dict]:
    """The records published to a rendezvous store (``meshtrain/doctor/rank<R>``)."""
    from datetime import timedelta

    records: dict[int, dict] = {}
    for rank in range(world_size):
        key = record_key(rank)
        try:
            if wait_s:
                store.wait([key], timedelta(seconds=wait_s))
            if store.check([key]):
                records[rank] = json.loads(store.get(key))
        except Exception:  # noqa: BLE001 - a rank that never published
            continue
    return records


def beat_key(rank: int) -> str:
    """The store key of ``rank``'s heartbeat: its node, address and collective counters,
    rewritten every few seconds while the network allows (``ledger.py``)."""
    return f"{STORE_PREFIX}beat{rank}"


def read_beats(store: Any, world_size: int, ranks: list[int] | None = None) -> dict[int, dict]:
    """The heartbeats in a rendezvous store (``meshtrain/doctor/beat<R>``), of every rank
    or of ``ranks``."""
    beats: dict[int, dict] = {}
    for rank in range(world_size) if ranks is None else ranks:
        key = beat_key(rank)
        try:
            if store.check([key]):
                beats[rank] = json.loads(store.get(key))
        except Exception:  # noqa: BLE001 - a rank that never beat
            continue
    return beats
