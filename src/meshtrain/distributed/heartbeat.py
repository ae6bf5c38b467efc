"""Each rank's heartbeat in the rendezvous store: what the other nodes know of it, last.

A rank's ledger record (:mod:`meshtrain.distributed.ledger`) is published when something
goes wrong -- but when the network between nodes is what went wrong, the record of a rank
on the far side never arrives, and a report built without it used to guess ("rank 1
never entered reduce_scatter #41") where it knew nothing. So while the network allows,
every rank rewrites a small heartbeat under ``meshtrain/doctor/beat<R>``: its node rank,
its address (the one it reaches the master with), and per group the last collective
number it entered and completed, with the time. The doctor then says what is true:
"rank 1 (node 1, 10.213.0.2) stopped answering ... last heard 6.2 s before", with the
collective it had entered by then.

Cost: one store ``set`` of ~200 bytes per rank every :func:`interval` (1/8 of the
collective timeout, between 0.25 and 1 s): 1 kB/s per rank to node 0's store.

It has a TCP store client of its own, with a short timeout (:data:`CLIENT_TIMEOUT_S`):
a cut link must not block it for the whole collective timeout, and the process group's
client must keep its own timeout. A thread still inside a store call when the interpreter
exits would abort the process ("terminate called without an active exception", exit 134
instead of the rank's code), so :meth:`Heartbeat.stop` waits for the call in flight
(at most the client's timeout) and the ledger calls it before the process ends.

On a node's local rank 0, the first heartbeats after start also copy every rank's
heartbeat into ``peers.json`` of this node's doctor folder: when the master node later
cannot be reached, the report still knows which node and address each rank had.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import weakref
from datetime import timedelta
from functools import partial
from typing import Any

from meshtrain.distributed.rank_records import DOCTOR_DIR_ENV, PEERS_FILE, beat_key, read_beats
from meshtrain.files.atomic import write_atomic

CLIENT_TIMEOUT_S = 2.0
PEERS_AFTER_BEATS = 3  # beats before local rank 0 copies the peers' (all ranks joined)


def interval(timeout_s: float) -> float:
    """Seconds between beats for a collective timeout of ``timeout_s``."""
    return min(1.0, max(0.25, timeout_s / 8))


def node_address() -> str | None:
    """The address this process reaches the master with (its node's address on the
    cluster network), from a UDP socket's route: nothing is sent."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "29500")
    if not host:
        return None
    try:
        with socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM
        ) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return None


class Heartbeat:
    """The thread that rewrites this rank's heartbeat (module doc)."""

    def __init__(self, ledger: Any) -> None:
        self._ledger = weakref.ref(ledger)
        self.every = interval(ledger.summary()["timeout_s"] or 8.0)
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held while a store call is in flight
        self._client: Any = None
        self.store_address: tuple[str, int] | None = ledger.store_address()

    def start(self) -> Heartbeat | None:
        if self.store_address is None:
            return None  # no TCP store (one process, a FileStore): nothing to beat into
        threading.Thread(target=self._run, name="meshtrain-heartbeat", daemon=True).start()
        return self

    def client(self) -> Any:
        """This heartbeat's store client (connected on first use), or None."""
        if self._client is None:
            from torch.distributed import TCPStore

            host, port = self.store_address
            self._client = TCPStore(
                host, port, is_master=False, wait_for_workers=False,
                timeout=timedelta(seconds=CLIENT_TIMEOUT_S),
            )  # fmt: skip
        return self._client

    def _run(self) -> None:
        beats = 0
        while not self._stop.is_set():
            led = self._ledger()
            if led is None:
                return
            mine = led.summary()
            stragglers = led.stragglers
            slow = led.in_flight() if stragglers is not None else []
            del led
            with self._busy:
                if self._stop.is_set():
                    return
                try:
                    self.client().set(beat_key(mine["rank"]), json.dumps(mine))
                    beats += 1
                    if beats == PEERS_AFTER_BEATS and mine.get("local_rank") == 0:
                        _write_peers(read_beats(self.client(), mine["world_size"]))
                    if slow:  # who this rank's slow collectives wait for (stragglers.py)
                        stragglers.look(
                            slow, partial(read_beats, self.client(), mine["world_size"])
                        )
                except Exception:  # noqa: BLE001 - the network is down: try again later
                    pass
            self._stop.wait(self.every)

    def read(self, world_size: int) -> dict[int, dict] | None:
        """Every rank's last heartbeat from the store; None when the store does not answer.
        Stops the beats first (this is the end of the rank's life)."""
        self.stop()
        if not store_answers(self.store_address):
            return None  # a store call over a dead link would block for minutes
        try:
            return read_beats(self.client(), world_size) or None
        except Exception:  # noqa: BLE001 - the store's node cannot be reached
            return None

    def stop(self) -> bool:
        """No more beats; True once no store call is in flight (False: one is stuck)."""
        self._stop.set()
        if self._busy.acquire(timeout=CLIENT_TIMEOUT_S * 3 + 1):
            self._busy.release()
            return True
        return False


def store_answers(address: tuple | None, timeout_s: float = CLIENT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the store at ``address`` opens within ``timeout_s``.

    Plain Python, so it cannot block past its timeout: a store client's call over a cut
    link blocks in C++ until TCP gives up (minutes), and a thread left there when the
    process exits aborts it."""
    if address is None:
        return False
    try:
        socket.create_connection((address[0], int(address[1])), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    return True


def _write_peers(beats: dict[int, dict]) -> None:
    folder = os.environ.get(DOCTOR_DIR_ENV)
    if not folder or not beats:
        return
    path = os.path.join(folder, PEERS_FILE)
    with contextlib.suppress(OSError):  # best effort: a doctor's file never stops training
        write_atomic(path, json.dumps({str(r): b for r, b in beats.items()}))


def read_peers(folder: str | None = None) -> dict[int, dict]:
    """Every rank's heartbeat as this node's ``peers.json`` kept it (see module doc)."""
    folder = folder or os.environ.get(DOCTOR_DIR_ENV)
    try:
        with open(os.path.join(folder or "", PEERS_FILE)) as f:
            return {int(r): b for r, b in json.load(f).items()}
    except (OSError, ValueError, TypeError):
        return {}


def link_down() -> str | None:
    """The name of this node's cluster interface (``GLOO_SOCKET_IFNAME``, or the one the
    master is reached through) when its link is down, else None."""
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/operstate") as f:
                if f.read().strip() == "down":
                    return name
        except OSError:
            continue
    return None
