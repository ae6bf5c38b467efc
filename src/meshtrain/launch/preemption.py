"""The launcher's half of checkpoint-on-pre-emption: relay the signal, report the save.

``meshtrain launch`` is the process a scheduler signals: PID 1 of a Kubernetes container
gets ``SIGTERM`` at the start of the grace period, ``srun`` and ``scancel --signal`` reach
the launcher of every node, and SLURM's ``--signal=B:USR1@60`` the batch shell that runs
it. torch's agent would answer ``SIGTERM`` by terminating the workers and, 30 s later,
killing them; and ``SIGUSR1`` would kill the launcher itself. Instead:

* :class:`SignalRelay` catches ``SIGTERM`` and ``SIGUSR1`` (torch is told to leave
  ``SIGTERM`` alone through ``TORCHELASTIC_SIGNALS_TO_HANDLE``) and sends the same signal
  to this node's workers, whose :class:`meshtrain.engine.preemption.PreemptionGuard`
  saves at the next step boundary on every rank and exits with code 75;
* once a signal arrived, a failed worker group is never restarted (the job is being
  stopped), and a group whose workers all exit with 75 (or 0) is a pre-emption, not a
  failure: the launcher prints ``pre-empted, checkpoint saved at step N (PATH)`` from the
  note the workers' local rank 0 wrote (``MESHTRAIN_PREEMPTION_NOTE``) and exits with 75,
  so a SLURM script or a Kubernetes Job can requeue on that code.

A second signal while the workers save is relayed too; the workers count and ignore it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from meshtrain.engine.preemption import NOTE_ENV, PREEMPTED_EXIT_CODE, SIGNALS, read_note

TORCH_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCH_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # torch's default without SIGTERM: ours


class SignalRelay:
    """Forwards ``SIGTERM``/``SIGUSR1`` to the agent's workers and remembers them."""

    def __init__(self, note_path: str) -> None:
        self.note_path = note_path
        self.received: list[int] = []
        self.agent: Any = None  # torch's agent, once it has started workers
        self._previous: dict[int, Any] = {}
        self._env: dict[str, str | None] = {}

    def install(self) -> SignalRelay:
        """Catch the signals; torch's agent must be given ``TORCH_SIGNALS`` as its
        ``signals_to_handle`` (it would otherwise take ``SIGTERM`` back)."""
        for key, value in ((TORCH_SIGNALS_ENV, TORCH_SIGNALS), (NOTE_ENV, self.note_path)):
            self._env[key] = os.environ.get(key)
            os.environ[key] = value  # the workers inherit the note's path
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._relay)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def _relay(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        pcontext = getattr(self.agent, "_pcontext", None)
        for pid in (pcontext.pids() if pcontext is not None else {}).values():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    @property
    def signalled(self) -> bool:
        return bool(self.received)

    def report(self) -> int | None:
        """After the workers left: the pre-emption line and code 75, or None when the
        workers did not stop for a pre-emption."""
        note = read_note(self.note_path)
        if note is None:
            return None
        import sys

        late = note.get("late_by")
        after = "" if late is None else f", {late} step(s) after the signal's step"
        print(
            f"meshtrain launch: pre-empted, checkpoint saved at step {note['step']}{after} "
            f"({note['path']}); exit code {PREEMPTED_EXIT_CODE}, run the job again to resume",
            file=sys.stderr,
            flush=True,
        )
        return PREEMPTED_EXIT_CODE


def preempted_failures(failures: dict) -> bool:
    """Every failed worker exited with the pre-emption code (torch's ``ProcessFailure``s)."""
    return bool(failures) and all(f.exitcode == PREEMPTED_EXIT_CODE for f in failures.values())


__all__ = ["TORCH_SIGNALS", "SignalRelay", "preempted_failures"]
