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

from meshtrain.files.atomic import atomic_file

PREEMPTED_EXIT_CODE = 75
SIGNALS = ("SIGTERM", "SIGUSR1")
_NEVER = 2**31 - 1  # above any step boundary count
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
        # step boundaries passed (``requested`` calls) in all, and when the first signal came:
        # the save is ``boundaries - noted_at`` boundaries after it (0: at the end of the
        # step it interrupted; 1: it came after that step's agreement)
        self.boundaries = 0
        self.noted_at: int | None = None  # this rank's first signal
        self.first_noted_at: int | None = None  # the earliest over the ranks, once agreed
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

    def _note(self, signum: int, frame: Any) -> None:
        if self.noted_at is None:
            self.noted_at = self.boundaries
        self.received.append(signum)

    @property
    def late_by(self) -> int | None:
        """Step boundaries between the first signal on any rank and the boundary that
        agreed on it (after ``requested`` returned True): 0 (the save ends the step the
        signal interrupted) or 1 (it came after that step's agreement); None before."""
        if self.first_noted_at is None:
            return None
        return self.boundaries - 1 - self.first_noted_at

    @property
    def signalled(self) -> bool:
        """This rank received a signal (the others may not know yet)."""
        return bool(self.received)

    def requested(self, group) -> bool:
        """Whether any rank of ``group`` (a ``comm.Group``; None for one process) was
        signalled. A collective: every rank calls it at the same step boundary."""
        # MAX of (NEVER - boundary of the signal), 0 where none: > 0 when some rank was
        # signalled, and NEVER - it is the earliest such boundary (still one 4-byte reduce)
        noted = self.noted_at
        flag = torch.tensor([0 if noted is None else _NEVER - noted], dtype=torch.int32)
        self.boundaries += 1
        if group is not None and group.size > 1 and group.pg is not None:
            import torch.distributed as dist

            if dist.get_backend(group.pg) == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.pg)
        value = int(flag.item())
        if value:
            self.first_noted_at = _NEVER - value
        return bool(value)


def write_note(step: int, path: Path | str | None, late_by: int | None = None) -> None:
    """Rank 0 of a node: tell the launcher (``MESHTRAIN_PREEMPTION_NOTE``) where the
    pre-emption checkpoint went, atomically (the launcher may read it any time), and how
    many step boundaries after this rank's signal (``PreemptionGuard.late_by``)."""
    target = os.environ.get(NOTE_ENV)
    if not target or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    with atomic_file(target) as f:
        json.dump(
            {"step": step, "path": None if path is None else str(path), "late_by": late_by}, f
        )


def read_note(target: str | os.PathLike) -> dict | None:
    """What :func:`write_note` wrote, or None."""
    try:
        return json.loads(Path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def preempt(step: int, path: Path | str | None, late_by: int | None = None) -> Preempted:
    """The exit after a pre-emption save: the launcher's note, then :class:`Preempted`."""
    write_note(step, path, late_by)
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
