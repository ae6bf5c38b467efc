"""The collective timeout after the first step: a slow first step is not a hang.

A job's first step is slow for reasons that are not faults: torch.compile, gloo/NCCL
warm-up, one node still loading its model or data while the others already wait in the
first collective. ``distributed.first_step_timeout_minutes`` lets that step wait longer than
the steady ``distributed.timeout_minutes`` without giving up the steady bound afterwards.

How: the default process group is created with the longer timeout (``init_process_group``'s
``timeout``, which also bounds its rendezvous), and once the Engine's first optimizer step
has finished, :func:`settle_timeout` sets every process group's backend to the steady
timeout (``Backend._set_default_timeout``: gloo reads the backend's timeout at each
collective, so the next one waits at most the steady timeout) and tells the ledger, whose
watchdog then reports a stall at 3/4 of the steady timeout. Subgroups made by
``new_group`` without a timeout get torch's 30-minute default; setting every group here
also brings them to the steady bound.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def set_group_timeouts(seconds: float) -> int:
    """Set the collective timeout of every live process group's backends to ``seconds``;
    return how many backends took it."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    changed = 0
    for pg in list(dist.distributed_c10d._world.pg_map):
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
            except Exception:  # noqa: BLE001 - this group has no backend for that device
                continue
            backend._set_default_timeout(timedelta(seconds=seconds))
            changed += 1
    return changed


def settle_timeout(distributed: Any, ledger: Any) -> None:
    """After the first step: the steady ``distributed.timeout_minutes`` for every group and
    for the ``ledger``'s watchdog. A no-op without ``first_step_timeout_minutes`` (then the
    group keeps whatever timeout it was created with)."""
    if distributed.first_step_timeout_minutes is None:
        return
    seconds = distributed.timeout_minutes * 60.0
    if set_group_timeouts(seconds):
        ledger.set_timeout(seconds)


def creation_timeout_minutes(timeout_minutes: float, first_step: float | None) -> float:
    """The timeout the process group is created with: the first step's when it is longer."""
    return max(timeout_minutes, first_step or 0.0)


__all__ = ["creation_timeout_minutes", "set_group_timeouts", "settle_timeout"]
