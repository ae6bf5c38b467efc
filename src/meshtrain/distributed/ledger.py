"""The collective ledger: what this rank last asked its groups to do, for the hang doctor.

Every collective and p2p call made through :mod:`meshtrain.distributed.comm` appends one
tuple to a small ring buffer (a ``deque`` with ``maxlen``) owned by the ``Topology``'s
``CommStats``::

    (group, seq, op, shapes, dtype, file, line, function, monotonic time)

``seq`` counts calls per group (the same ``Group`` object), so on every member of a group
the n-th collective has the same number: comparing the numbers across ranks is how the
doctor (:mod:`meshtrain.distributed.doctor`) tells "rank 1 never entered all_reduce #14"
from "ranks disagree at #14" (a desync). The caller's frame is read with
``sys._getframe`` (file, line and name only: keeping the frame would keep its tensors
alive). Recording costs one tuple and an append, about a microsecond, next to a collective.

A record of this ledger is *published* (written as JSON) when something goes wrong:

* a collective raises (timeout, a peer's connection closed): reason ``"error"``;
* the watchdog thread sees no collective activity for 3/4 of the process group's
  timeout: reason ``"stalled"``, with this rank's Python stack, so a rank stuck in
  Python code (not in a collective) says where it is before its peers time out;
* an uncaught exception ends the process: reason ``"exception"``, with the traceback;
* the interpreter exits (``sys.exit(n)`` mid-job included): reason ``"exit"``.

Where: the rendezvous store under ``meshtrain/doctor/rank<R>`` (a TCP store, which still
answers when the process group is wedged; written from a helper thread with a short
deadline so a dead store never blocks the exit), and, when ``MESHTRAIN_DOCTOR_DIR`` is set
(``meshtrain launch`` and ``notebook_launcher`` set it), ``rank<R>.json`` in that folder.
The key is written at the *root* of the store (below any ``PrefixStore``), whose address
each rank notes in its ``hello<R>.json``, so that a launcher on any node can connect to
the store and read every rank's record, its remote peers' included
(:func:`meshtrain.distributed.doctor.read_job`); the folder holds only this node's.
``MESHTRAIN_LEDGER=0`` turns the ledger off (for the overhead benchmark).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any

from meshtrain.distributed.heartbeat import Heartbeat, store_answers
from meshtrain.distributed.heartbeat import node_address as _node_address
from meshtrain.distributed.rank_records import DOCTOR_DIR_ENV, attempt, read_store, record_key
from meshtrain.distributed.silence import explain_failure
from meshtrain.distributed.store_io import (
    pg_timeout_seconds,
    root_store,
    store_address,
    store_set,
    write_status,
)  # fmt: skip
from meshtrain.distributed.stragglers import Stragglers, threshold

CAPACITY = 64
STALL_FRACTION = 0.75  # of the collective timeout, before the watchdog reports a stall
# point-to-point calls are numbered per group too, but a send on one stage and a receive on
# the next need not share a number: only collectives say who is behind (stragglers.py)
P2P_OPS = ("send", "recv", "batch_p2p", "isend", "irecv")
RUN_DIR_ENV = "MESHTRAIN_RUN_DIR"


def ledger_enabled() -> bool:
    return os.environ.get("MESHTRAIN_LEDGER", "1") not in ("0", "false", "off")


class Ledger:
    """This rank's recent collectives, with per-group sequence numbers (see module doc)."""

    def __init__(self, capacity: int = CAPACITY, *, watch: bool | None = None) -> None:
        self.entries: deque[tuple] = deque(maxlen=capacity)
        self.enabled = ledger_enabled()
        self._seq: dict[Any, int] = {}  # Group -> last sequence number entered
        self._done: dict[Any, int] = {}  # Group -> last sequence number completed
        self.last_activity = time.monotonic()
        self._stack: str | None = None
        self._error: str | None = None
        self._published_reason: str | None = None
        self._failed_in: tuple | None = None  # (group, ranks, seq, op) of a failed collective
        self._address: str | None = None
        self._beats: Any = None  # the Heartbeat, while the group lives
        self.stragglers: Stragglers | None = None  # slow collectives, with a heartbeat
        import torch.distributed as dist

        active = self.enabled and dist.is_available() and dist.is_initialized()
        if active and dist.get_world_size() > 1:
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
            self._timeout = pg_timeout_seconds()
            self._address = _node_address()
            self._hello()
            if watch is None or watch:
                _start_watchdog(self)
                self._beats = Heartbeat(self).start()
                if self._beats is not None:
                    self.stragglers = Stragglers(self._rank, threshold(self._beats.every))
            _install_hooks(self)
        else:
            self._rank, self._world, self._timeout = 0, 1, None

    # the hot path ----------------------------------------------------------------------
    def enter(self, group: Any, op: str, tensors: tuple, depth: int = 3) -> int:
        """Record that this rank enters ``op`` on ``group``; return its sequence number.

        ``depth`` is how many frames up the user of :mod:`comm` sits (comm's ``_call`` is
        1, the public function 2, its caller 3)."""
        seq = self._seq.get(group, 0) + 1
        self._seq[group] = seq
        f = sys._getframe(depth)
        t = tensors[0]
        self.entries.append(
            (
                group,
                seq,
                op,
                tuple(tuple(x.shape) for x in tensors),
                t.dtype,
                f.f_code.co_filename,
                f.f_lineno,
                f.f_code.co_name,
                time.monotonic(),
            )
        )
        self.last_activity = self.entries[-1][8]
        return seq

    def done(self, group: Any, seq: int) -> None:
        if seq > self._done.get(group, 0):
            self._done[group] = seq
        self.last_activity = time.monotonic()
        if self.stragglers is not None:
            self.stragglers.completed(group, seq)

    def failed(self, group: Any, seq: int, exc: BaseException) -> None:
        """A collective raised: publish (store and file) before the error propagates."""
        self._error = f"{type(exc).__name__}: {exc}".strip()
        op = next((e[2] for e in reversed(self.entries) if e[0] is group and e[1] == seq), "?")
        self._failed_in = (group.name, list(group.ranks), seq, op)
        self.publish("error")

    def track(self, work: Any, group: Any, seq: int) -> Any:
        """Wrap an async work handle so its ``wait()`` marks the entry completed."""
        return _Tracked(work, self, group, seq)

    def _snapshot(self) -> tuple[list, dict, dict]:
        """Copies of the entries and of each group's entered and completed numbers, taken
        from another thread (heartbeat, watchdog) while autograd threads may append."""
        for _ in range(100):
            try:
                return list(self.entries), dict(self._seq), dict(self._done)
            except RuntimeError:  # changed size during the copy
                continue
        return [], {}, {}

    # publishing ------------------------------------------------------------------------
    def record(self, reason: str) -> dict[str, Any]:
        """This rank's JSON-able report (see :mod:`meshtrain.distributed.doctor`)."""
        entries, seqs, dones = self._snapshot()
        now_mono, now = time.monotonic(), time.time()
        rows = [
            {
                "group": g.name,
                "ranks": list(g.ranks),
                "seq": seq,
                "op": op,
                "shapes": [list(s) for s in shapes],
                "dtype": str(dtype).replace("torch.", ""),
                "where": f"{file}:{line}",
                "function": func,
                "done": seq <= dones.get(g, 0),
                "seconds_ago": round(now_mono - t, 3),
            }
            for (g, seq, op, shapes, dtype, file, line, func, t) in entries
        ]
        return {
            "rank": self._rank,
            "world_size": self._world,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "attempt": attempt(),
            "node_rank": _env_int("GROUP_RANK"),
            "local_rank": _env_int("LOCAL_RANK"),
            "address": self._address,
            "time": now,
            "reason": reason,
            "error": self._error,
            "timeout_s": self._timeout,
            "idle_s": round(now_mono - self.last_activity, 3),
            "groups": [
                {"group": g.name, "ranks": list(g.ranks), "entered": s, "done": dones.get(g, 0)}
                for g, s in seqs.items()
            ],
            "entries": rows,
            "stack": self._stack,
            "run_dir": os.environ.get(RUN_DIR_ENV),
        }

    def publish(self, reason: str, *, store: bool = True) -> dict[str, Any]:
        """Write this rank's record to the rendezvous store and the doctor folder."""
        self._published_reason = reason
        rec = self.record(reason)
        text = json.dumps(rec)
        folder = os.environ.get(DOCTOR_DIR_ENV)
        if folder:
            write_status(os.path.join(folder, f"rank{self._rank}.json"), text)
        if store:
            store_set(record_key(self._rank), text)
        return rec

    def summary(self) -> dict[str, Any]:
        """What this rank's heartbeat says (:mod:`meshtrain.distributed.heartbeat`): who
        and where it is, and per group the last collective entered and completed."""
        _, seqs, dones = self._snapshot()
        return {
            "rank": self._rank,
            "world_size": self._world,
            "node_rank": _env_int("GROUP_RANK"),
            "local_rank": _env_int("LOCAL_RANK"),
            "address": self._address,
            "host": socket.gethostname(),
            "attempt": attempt(),
            "time": time.time(),
            "timeout_s": self._timeout,
            "groups": [
                {"group": g.name, "ranks": list(g.ranks), "entered": s, "done": dones.get(g, 0)}
                for g, s in seqs.items()
            ],
        }

    def in_flight(self) -> list[tuple[Any, int, str, float]]:
        """``(group, seq, op, entered at)`` of each group's collective this rank entered
        and has not completed (the heartbeat thread's question for ``stragglers``)."""
        entries, seqs, dones = self._snapshot()
        return [
            (g, seq, op, t)
            for (g, seq, op, _s, _d, _f, _l, _fn, t) in entries
            if seq == seqs.get(g) and seq > dones.get(g, 0) and op not in P2P_OPS
        ]

    def take_stragglers(self) -> list[dict]:
        """The slow collectives since the last call and whom they waited for
        (:mod:`meshtrain.distributed.stragglers`); empty without a heartbeat."""
        return [] if self.stragglers is None else self.stragglers.take()

    def store_address(self) -> tuple[str, int] | None:
        return None if (a := store_address()) is None else (a[0], int(a[1]))

    def set_timeout(self, seconds: float) -> None:
        """The groups' collective timeout changed (:func:`timeouts.settle_timeout`)."""
        self._timeout = seconds

    def capture_stack(self) -> None:
        """Keep the main thread's Python stack (for a stall report)."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is not None:
            self._stack = "".join(traceback.format_stack(frame))

    def _hello(self) -> None:
        """A first, tiny record so the launcher knows each rank's pid (to find a stopped
        one) and the store's address (to read the other nodes' records) before trouble."""
        folder = os.environ.get(DOCTOR_DIR_ENV)
        if folder:
            hello = {
                "rank": self._rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "world_size": self._world,
                "attempt": attempt(),
                "store": store_address(),
                "node_rank": _env_int("GROUP_RANK"),
                "address": self._address,
            }
            write_status(os.path.join(folder, f"hello{self._rank}.json"), json.dumps(hello))


class _Tracked:
    """An async work handle whose ``wait()`` marks its ledger entry done (or published)."""

    __slots__ = ("_work", "_ledger", "_group", "_seq")

    def __init__(self, work: Any, ledger: Ledger, group: Any, seq: int) -> None:
        self._work, self._ledger, self._group, self._seq = work, ledger, group, seq

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self._work.wait(*args, **kwargs)
        except Exception as exc:
            self._ledger.failed(self._group, self._seq, exc)
            raise
        self._ledger.done(self._group, self._seq)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _start_watchdog(ledger: Ledger) -> None:
    """A daemon thread reporting a stall: no collective activity for 3/4 of the timeout.

    It holds only a weak reference, so it ends when the topology (and ledger) is gone.
    """
    if not ledger._timeout:
        return
    poll = max(0.05, min(1.0, ledger._timeout * STALL_FRACTION / 10))
    ref = weakref.ref(ledger)

    def watch() -> None:
        reported_at = None
        while True:
            time.sleep(poll)
            led = ref()
            if led is None:
                return
            last = led.last_activity
            exiting = led._published_reason == "exit"  # its exit record must stay
            # the limit is read each time: settle_timeout shortens it after the first step
            late = time.monotonic() - last > led._timeout * STALL_FRACTION
            if not exiting and late and reported_at != last:
                reported_at = last
                led.capture_stack()
                led.publish("stalled")
            del led

    threading.Thread(target=watch, name="meshtrain-ledger-watchdog", daemon=True).start()


def _peer_first(ledger: Ledger) -> dict | None:
    """The first record of a peer that raised outside a collective or left the job (an
    exit record), from the store, if any: why this rank's collective failed."""
    found: list[dict] = []
    if not store_answers(ledger.store_address()):
        return None  # its node is unreachable: a read would block in C++ for minutes

    def look() -> None:
        this = attempt()
        for rank, rec in read_store(root_store(), ledger._world).items():
            # the agent's store outlives a restart: an earlier attempt's record is stale
            if rank != ledger._rank and rec.get("reason") in ("exception", "exit"):
                if rec.get("attempt", 0) == this:
                    found.append(rec)

    t = threading.Thread(target=look, name="meshtrain-doctor-read", daemon=True)
    t.start()
    t.join(3.0)
    return min(found, key=lambda r: r.get("time", 0)) if found else None


def _install_hooks(ledger: Ledger) -> None:
    """Publish on an uncaught exception (with its traceback) and at interpreter exit."""
    ref = weakref.ref(ledger)
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        led = ref()
        if led is None or issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        if led._published_reason != "error":  # not a collective's error (published then)
            led._error = f"{exc_type.__name__}: {exc}".strip()
            led._stack = "".join(traceback.format_exception(exc_type, exc, tb))
            led.publish("exception")
            return previous(exc_type, exc, tb)
        first = _peer_first(led)
        if first is None:
            said = led._failed_in and explain_failure(
                led._failed_in, led._error, led._timeout, led._rank, led._world,
                led._address, led._beats,
            )  # fmt: skip
            if led._beats is not None:
                led._beats.stop()
            if said is None:
                return previous(exc_type, exc, tb)
            # the peer went silent (a cut link, a dead node): this line says who and
            # where; the backend's traceback ("Timed out waiting 6000ms for recv") says
            # nothing more, so it goes to this rank's record, not above the verdict
            led._stack = "".join(traceback.format_exception(exc_type, exc, tb))
            led.publish("error", store=False)
            sys.stderr.write(f"[rank{led._rank}]: meshtrain: {said}\n")
            sys.stderr.flush()
            if led._beats is not None and not led._beats.stop():
                # a heartbeat stuck in a store call would abort the process at exit
                # ("terminate called without an active exception"): leave with our code
                os._exit(1)
            return None
        # a collective failed because a peer raised or left first: its traceback (already
        # printed by that rank) or the doctor's table says why; ours would only bury it
        if first["reason"] == "exception":
            cause = f"raised first: {first['error']}; see its traceback"
        else:
            cause = "left the job first (its process exited); see the doctor's table"
        # one write: under PYTHONUNBUFFERED print() writes the text and the newline
        # separately, and every survivor of the failed peer says this at the same moment
        sys.stderr.write(
            f"[rank{led._rank}]: meshtrain: a collective failed ({led._error.splitlines()[0]}) "
            f"because rank {first['rank']} {cause}\n"
        )
        sys.stderr.flush()

    sys.excepthook = hook

    def at_exit() -> None:
        # to the store too: a launcher on another node learns only from there that this
        # rank left (sys.exit) while its peers may still be waiting for it
        led = ref()
        if led is not None and led._published_reason not in ("exception", "error"):
            led.publish("exit")
        if led is not None and led._beats is not None:
            led._beats.stop()  # no store call may be in flight when the process ends

    atexit.register(at_exit)
