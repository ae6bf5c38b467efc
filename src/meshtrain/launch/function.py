"""``notebook_launcher``: run a function on N local processes from a notebook or a script.

A thin front over :func:`meshtrain.launch.processes.run_on_ranks`, which does the work:
each process gets torchrun's environment, joins a real process group (gloo on CPU, NCCL
on GPUs) before the function runs, and leaves it cleanly after. Processes are forked
where the platform allows, which is what lets a function defined in ``__main__`` or in a
notebook cell run without being importable; the one thing fork cannot survive is a CUDA
context already created in the parent, so that is checked first with a message saying
what to do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshtrain.errors import ConfigError, DistributedError
from meshtrain.launch.launcher import default_nproc_per_node
from meshtrain.launch.processes import run_on_ranks


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    start_method: str | None = None,
    env: Mapping[str, str] | None = None,
    collective_timeout_minutes: float = 5.0,
) -> list[Any]:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` local ranks; wait for all.

    Inside ``function`` the default process group already exists (``meshtrain.init_
    distributed()`` returns its rank and world size), so collectives work directly.

    Args:
        function: any callable, including one defined in ``__main__`` or a notebook.
        args: positional arguments, the same for every rank.
        num_processes: how many ranks; default the number of GPUs, else 1 (with a notice).
        kwargs: keyword arguments, the same for every rank.
        timeout: seconds before a hang is reported with every live rank's Python stacks;
            ``None`` waits as long as the function runs.
        start_method: ``"fork"`` (default where available) or ``"spawn"`` (the function
            must then be importable: defined in a module, not in ``__main__``).
        env: extra environment variables for the ranks.
        collective_timeout_minutes: how long a collective may wait for a peer.

    Returns:
        The function's return values, indexed by rank.

    Raises:
        RankFailedError: a rank raised, died or hung; the message carries that rank's
            exception message and traceback, and ``.rank`` says which rank it was.
    """
    if num_processes is None:
        nproc, notice = default_nproc_per_node()
        num_processes = int(nproc)
        if notice:
            print(notice.replace("meshtrain launch", "notebook_launcher"), file=sys.stderr)
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ConfigError(f"num_processes={num_processes!r}: expected an integer >= 1")
    if start_method in (None, "fork") and _cuda_initialized():
        raise DistributedError(
            "CUDA is already initialised in this process, and forked ranks cannot use it. "
            "Restart the kernel and create models/tensors on the GPU only inside the "
            "launched function (or pass start_method='spawn' with an importable function)."
        )
    return run_on_ranks(
        function,
        num_processes,
        tuple(args),
        dict(kwargs or {}),
        timeout=timeout,
        start_method=start_method,
        env=dict(env or {}),
        collective_timeout_minutes=collective_timeout_minutes,
    )


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")  # never import torch just to ask
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())
