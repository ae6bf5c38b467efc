"""``PreemptionGuard`` in one process: a signal is only noted in the handler, the step
boundary that agrees on it is the next ``requested`` call, and ``late_by`` counts the
boundaries between the signal and that agreement exactly (0: the save ends the step the
signal interrupted). The 2-rank agreement is covered end to end by
``test_preemption_job.py``."""

from __future__ import annotations

import os
import signal

from meshtrain.engine.preemption import PreemptionGuard


def test_guard_agrees_at_the_next_boundary_and_counts_it():
    guard = PreemptionGuard().install()
    try:
        assert not guard.requested(None) and not guard.requested(None)  # boundaries 1, 2
        assert guard.late_by is None and not guard.signalled
        os.kill(os.getpid(), signal.SIGUSR1)  # during step 3
        assert guard.signalled
        assert guard.requested(None)  # the end of step 3 agrees
        assert guard.late_by == 0 and guard.noted_at == 2
        os.kill(os.getpid(), signal.SIGTERM)  # a second one is noted, changes nothing
        assert guard.received == [signal.SIGUSR1, signal.SIGTERM] and guard.noted_at == 2
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not guard._note
