"""The one harness every multi-rank test uses.

``run_ranks(fn, n, *args)`` runs ``fn`` on ``n`` real processes joined in a gloo process
group (free port, torchrun's environment), returns the per-rank results, and turns a
failing rank's traceback or a hang (with every live rank's Python stack) into the pytest
failure. ``fn`` must be a module-level function; keep several checks per call because each
group costs process start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshtrain.launch.processes import RankFailedError, run_on_ranks

DEFAULT_TIMEOUT_S = 240.0

__all__ = ["RankFailedError", "run_ranks"]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    return run_on_ranks(fn, world_size, args, kwargs, timeout=timeout, env=env)
