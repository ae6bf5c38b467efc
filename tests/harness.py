"""The one harness every multi-rank test uses.

``run_ranks(fn, n, *args)`` runs ``fn`` on ``n`` real processes joined in a gloo process
group (free port, torchrun's environment), returns the per-rank results, and turns a
failing rank's traceback or a hang (with every live rank's Python stack) into the pytest
failure. ``fn`` must be a module-level function; keep several checks per call because each
group costs process start-up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from meshtrain.launch.processes import RankFailedError, run_on_ranks

DEFAULT_TIMEOUT_S = 240.0
# Intra-op threads per rank. One by default (ranks share 2 cores); the kernel-matrix job
# (tools/kernel_matrix.py) sets 2, because a GEMM split over threads blocks its sums
# differently, and a parity bound must hold for either.
RANK_THREADS_ENV = "MESHTRAIN_TEST_RANK_THREADS"
# The running test's pytest-timeout deadline (epoch seconds), set by tests/conftest.py. The
# wait on the ranks ends this long before it, time enough to gather the hung ranks' stacks.
TEST_DEADLINE_ENV = "MESHTRAIN_TEST_DEADLINE"
STACKS_MARGIN_S = 30.0

__all__ = ["RankFailedError", "run_ranks"]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    deadline = os.environ.get(TEST_DEADLINE_ENV)
    if deadline:
        timeout = max(1.0, min(timeout, float(deadline) - time.time() - STACKS_MARGIN_S))
    return run_on_ranks(
        fn, world_size, args, kwargs, timeout=timeout, env=env, threads_per_rank=rank_threads()
    )


def rank_threads() -> int:
    """The intra-op threads of each rank: what a one-process reference must use too when it
    is compared with the ranks bit for bit (a GEMM split over threads blocks its sums
    differently)."""
    return int(os.environ.get(RANK_THREADS_ENV, "1"))
