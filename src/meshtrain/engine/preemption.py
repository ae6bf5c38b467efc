"""Checkpoint on pre-emption: a signal becomes a save at the next step boundary on every rank.

SLURM and Kubernetes stop a job with ``SIGTERM`` and a grace period (SLURM's
``--signal=USR1@60`` sends ``SIGUSR1`` ahead of time), then ``SIGKILL``. The handler
installed here only *notes* the signal (it runs between two Python bytecodes of the main
thread, maybe in the middle of a collective's wait, so it must not save or raise there).
At each step boundary the loop asks :meth:`PreemptionGuard.requested`: one ``all_reduce``
(MAX) of one int over the world group, so every rank learns at the *same* step that some
rank was signalled -- a signal that reaches rank 0 before and rank 1 after a boundary
still stops both at the next one. The loop then finishes nothing more: it saves a normal
(synchronous, atomic) checkpoint and raises :class:`Preempted`, a ``SystemExit`` with
:data:`PREEMPTED_EXIT_CODE`.

A second signal during the save is counted and ignored: the save goes on and commits
atomically (a ``SIGKILL`` at the end of the grace period leaves the previous ``latest``,
see docs/checkpoints.md, *Crash safety*).

Cost: one 4-byte all-reduce per optimizer step while enabled.

Exit code 75 is ``EX_TEMPFAIL`` of sysexits.h ("temporary failure, the user is invited
to retry"): the job did not fail, it should be requeued. ``meshtrain launch`` reports it
as ``pre-empted, checkpoint saved at step N`` from the note rank 0 of each node writes
(:func:`write_note`) into the launcher's folder.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch

PREEMPTED_EXIT_CODE = 75
SIGNALS = ("SIGTERM", "SIGUSR1")
NOTE_ENV = "MESHTRAIN_PREEMPTION_NOTE"  # the launcher's file for "saved at step N"


class Preempted(SystemExit):
    """Raised after the pre-emption checkpoint is committed; exits with code 75.

    ``step``: the step the checkpoint holds; ``path``: its folder.
    """

    def __init__(self, step: int, path: Path | str | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.path = step, None if path is None else Path(path)

    def __str__(self) -> str:
        return f"pre-empted, checkpoint saved at step {self.step} ({self.path})"


class PreemptionGuard:
    """Notes ``SIGTERM``/``SIGUSR1`` and lets every rank agree on them at a step boundary.

    ``install()`` must run on the main thread (Python's rule for signal handlers); it keeps
    the previous handlers, which ``uninstall()`` puts back. ``auto``: the engine saves and
    exits by itself in ``step()``; a caller with its own state to save (the Trainer) sets it
    False and calls :meth:`requested` where its step ends.
    """

    def __init__(self, signals: tuple[str, ...] = SIGNALS) -> None:
        self.signals = tuple(getattr(signal, s) for s in signals if hasattr(signal, s))
        self.received: list[int] = []  # signal numbers, in order (a second one is ignored)
        self.auto = True
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals are delivered to the main thread only; nothing to catch
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._note)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _note(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal's API
        self.received.append(signum)

    @property
    def signalled(self) -> bool:
        """This rank received a signal (the others may not know yet)."""
        return bool(self.received)

    def requested(self, group) -> bool:
        """Whether any rank of ``group`` (a ``comm.Group``; None for one process) was
        signalled. A collective: every rank calls it at the same step boundary."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        if group is None or group.size == 1 or group.pg is None:
            return bool(flag.item())
        import torch.distributed as dist

        if dist.get_backend(group.pg) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.pg)
        return bool(flag.item())


def write_note(step: int, path: Path | str | None) -> None:
    """Rank 0 of a node: tell the launcher (``MESHTRAIN_PREEMPTION_NOTE``) where the
    pre-emption checkpoint went, atomically (the launcher may read it any time)."""
    target = os.environ.get(NOTE_ENV)
    if not target or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step, "path": None if path is None else str(path)}, f)
    os.replace(tmp, target)


def read_note(target: str | os.PathLike) -> dict | None:
    """What :func:`write_note` wrote, or None."""
    try:
        return json.loads(Path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def preempt(step: int, path: Path | str | None) -> Preempted:
    """The exit after a pre-emption save: the launcher's note, then :class:`Preempted`."""
    write_note(step, path)
    return Preempted(step, path)


__all__ = [
    "NOTE_ENV",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "PreemptionGuard",
    "preempt",
    "read_note",
    "write_note",
]
