"""The node's elastic agent: torch's ``LocalElasticAgent``, patient with ranks on their way out.

torch's agent polls its workers every ``--monitor_interval`` and, the moment one has
failed, sends ``SIGTERM`` to every other. When rank 1 raises outside a collective, rank 0
is typically blocked in a collective with it: rank 1's exit closes its sockets, rank 0's
collective fails ("Connection closed by peer"), rank 0 publishes its ledger record, reads
from the store that rank 1 raised first and prints one line saying so
(:mod:`meshtrain.distributed.ledger`) -- and all of that races the agent's ``SIGTERM``.
Whenever the poll lands first, rank 0 dies mid-sentence (or before it even noticed, with
no record at all). A longer monitor interval only shrinks the window: the poll's phase
is random.

The race is closed in the agent, not by timing: when some local workers have exited and
others still run, the agent keeps reporting the group healthy (does not stop anyone) while
a running worker may still leave *on its own*, for at most :data:`GRACE_S` from the first
exit it saw. A running worker is expected to leave on its own unless

* it published a ``stalled`` record (it is stuck in Python code, not in a collective: its
  peers' leaving will not wake it; the hang case must not wait), or
* it is stopped (``SIGSTOP``, process state ``T``; the launcher's stop watcher kills it).

Everything else -- a rank whose collective already failed (an ``error`` record, it is
explaining itself) or one that has not noticed yet (no record; its peer's sockets are
closed, so its next or current collective fails within milliseconds) -- gets the grace.
Once every worker has exited, or the grace is over, torch's own monitoring runs as
before (the failures, ``SIGTERM`` to whoever is left, the restart or the
``ChildFailedError``). So the failure's report is the same, except that the survivors
usually exit with their own code 1 rather than "killed by SIGTERM", and each has had its
say. Exited workers are seen in ``/proc`` (a zombie, state ``Z``, or gone) without
reaping them, so torch's ``Popen`` objects still collect their exit codes.

Cost: a stop after a rank raised waits for the survivors' explanations (typically well
under a second; each store access in them has a 3 s deadline). A worker that keeps
computing without a collective delays the stop by up to :data:`GRACE_S`. Each node's
agent applies the rule to its own workers, from its own node's doctor folder.

The agent is swapped in by name (``torch.distributed.launcher.api.LocalElasticAgent``)
for the duration of :func:`patient_agent`, in the launcher's own process, which exists
only to be this agent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

PREEMPT_WAIT_S = 120.0  # the longest the other ranks may take to leave after one saved
GRACE_S = 10.0  # how long survivors may take to explain and leave by themselves


def process_state(pid: int) -> str | None:
    """The one-letter state of a local process from /proc (None where it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def leaving_on_their_own(
    states: Mapping[int, str | None], records: Mapping[int, dict]
) -> list[int]:
    """The ranks the agent should wait for before stopping them (see the module doc).

    ``states`` maps each local worker's global rank to its process state (``None`` or
    ``"Z"``: exited); ``records`` are the doctor folder's ledger records by rank. Empty
    unless some worker exited while others still run.
    """
    exited = {r for r, s in states.items() if s in (None, "Z")}
    if not exited or len(exited) == len(states):
        return []
    return sorted(
        r
        for r, s in states.items()
        if r not in exited and s != "T" and records.get(r, {}).get("reason") != "stalled"
    )


def rendezvous_round(handler) -> int | None:
    """The round of the rendezvous just completed, the same on every node, or None.

    torch's dynamic (c10d, etcd-v2) handler keeps it in its state holder; no public API
    says it. A static rendezvous has no rounds (None: the restart count is used)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    number = getattr(state, "round", None)
    return number if isinstance(number, int) else None


def _agent_class(base: type, relay=None) -> type:
    """``base`` (torch's LocalElasticAgent) with the grace of the module doc, and the
    pre-emption rules of :mod:`meshtrain.launch.preemption` (``relay``: its SignalRelay)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from meshtrain.distributed.doctor import read_folder
    from meshtrain.distributed.ledger import DOCTOR_DIR_ENV
    from meshtrain.distributed.rank_records import ROUND_ENV
    from meshtrain.launch.preemption import preempted_failures

    class PatientAgent(base):
        _first_exit: float | None = None  # when this attempt's first exit was seen
        _first_preempted: float | None = None  # when a worker first exited with 75

        def _start_workers(self, worker_group):
            # the workers inherit this process's environment: the round numbers their
            # store keys alike on every node (rank_records.attempt)
            number = rendezvous_round(worker_group.spec.rdzv_handler)
            if number is None:
                os.environ.pop(ROUND_ENV, None)
            else:
                os.environ[ROUND_ENV] = str(number)
            started = super()._start_workers(worker_group)
            if relay is not None:
                relay.agent = self  # the relay signals these workers
            return started

        def _monitor_workers(self, worker_group):
            if self._pcontext is not None and self._waiting(worker_group):
                return RunResult(state=WorkerState.HEALTHY)
            result = super()._monitor_workers(worker_group)
            if result.state != WorkerState.FAILED:
                return result
            if preempted_failures(result.failures):
                # every rank saved the same step: wait for the last to leave, then it is
                # a pre-emption (run_agent reports it), never a restart
                now = time.monotonic()
                self._first_preempted = self._first_preempted or now
                if self._any_alive() and now - self._first_preempted < PREEMPT_WAIT_S:
                    return RunResult(state=WorkerState.HEALTHY)
                if not self._any_alive():  # torch's books want every worker's value
                    values = {w.global_rank: None for w in worker_group.workers}
                    return RunResult(state=WorkerState.SUCCEEDED, return_values=values)
            if relay is not None and relay.signalled:
                self._remaining_restarts = 0  # the job is being stopped: no restart
            return result

        def _any_alive(self) -> bool:
            pids = self._pcontext.pids().values()
            return any(process_state(pid) not in (None, "Z") for pid in pids)

        def _waiting(self, worker_group) -> bool:
            pids = self._pcontext.pids()
            states = {
                worker_group.workers[local].global_rank: process_state(pid)
                for local, pid in pids.items()
            }
            if all(s not in (None, "Z") for s in states.values()):
                self._first_exit = None  # a fresh group (first start or a restart)
                return False
            folder = os.environ.get(DOCTOR_DIR_ENV)
            records = read_folder(folder)[0] if folder else {}
            if not leaving_on_their_own(states, records):
                return False
            now = time.monotonic()
            if self._first_exit is None:
                self._first_exit = now
            return now - self._first_exit < GRACE_S

    return PatientAgent


@contextmanager
def patient_agent(relay=None) -> Iterator[None]:
    """Within this block, ``torch.distributed.run.run`` builds the patient agent."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _agent_class(original, relay)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original
