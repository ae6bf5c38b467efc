"""Run one Python function on N local processes as a real torch.distributed job.

This is the engine under both ``meshtrain.notebook_launcher`` and the test harness
(``tests/harness.py``). Each child gets the environment torchrun would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free port), joins the
process group (once every rank has started, so that a short collective timeout bounds
the collectives and not a late start), runs the function and sends back its return
value or its traceback; a port that another process took between choosing and binding
it is retried on a fresh one. The parent kills every rank as soon as one fails, and on
a timeout first asks each live rank to dump its Python stacks (``faulthandler`` on
``SIGUSR1``) so a hang reads like a bug report rather than a silence. The ranks publish their collective ledgers into a private
doctor folder (``MESHTRAIN_DOCTOR_DIR``), and a failure's message ends with the hang
doctor's table (:mod:`meshtrain.distributed.doctor`).

Start method: ``fork`` where available (children inherit the imported torch, which makes
spawning several groups per test module cheap, and functions defined in ``__main__`` or a
notebook work); ``spawn`` otherwise or on request. Each child sets its intra-op threads
(default 1, as torchrun does with OMP_NUM_THREADS=1) before any torch work, which is also
what makes fork safe with OpenMP. The ranks are forked with the
parent's heap outside their collector (:mod:`meshtrain.forking`): a rank must never run
the destructor of an object it inherited in a reference cycle (a dropped Accelerator's
gloo groups hung CI that way).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import DistributedError
from meshtrain.forking import heap_frozen

PORT_TRIES = 3  # free_port() is free when chosen; another process may bind it first
JOIN_WAIT_S = 300.0  # at most, for every rank to be started before joining the group
STACKS_WAIT_S = 10.0  # at most, for hung ranks to dump their stacks after SIGUSR1


class RankFailedError(DistributedError):
    """A rank raised, died or hung; the message carries its traceback or stacks."""

    def __init__(self, message: str, rank: int | None = None, exc_type: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.port_taken = False  # rank 0 could not bind the store's port (run_on_ranks retries)


def _port_in_use(message: str) -> bool:
    return "EADDRINUSE" in message or "address already in use" in message.lower()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    stage: str = "run"  # "init": it failed joining the process group, before fn ran


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    extra_env: Mapping[str, str],
    threads: int,
    setup_distributed: bool,
    timeout_minutes: float,
    stack_file: str,
    results: Any,
    started: Any,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "OMP_NUM_THREADS": str(threads),
            **extra_env,
        }
    )
    stacks = open(stack_file, "w")  # noqa: SIM115 - must outlive this frame for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch
    import torch.distributed as dist

    from meshtrain.distributed.env import init_distributed, shutdown_distributed

    torch.set_num_threads(threads)
    ok = False
    stage = "init"
    try:
        if setup_distributed:
            # the ranks start together, so that a short collective timeout (a test of a
            # hang) bounds the collectives, not one rank's late start on a loaded machine
            try:
                started.wait(JOIN_WAIT_S)
            except threading.BrokenBarrierError:
                pass  # a rank never came: joining the group says so
            init_distributed(timeout_minutes=timeout_minutes)
        stage = "run"
        value = fn(*args, **kwargs)
        outcome = _Outcome(rank, True, value)
        ok = True
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        outcome = _Outcome(
            rank,
            False,
            exc_type=type(exc).__name__,
            message=str(exc),
            traceback=traceback.format_exc(),
            stage=stage,
        )
    # Plain pickle to bytes: torch's multiprocessing reducers would pass tensors as shared
    # memory file descriptors, which die with this process before the parent reads them.
    try:
        payload = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - the return value may not pickle
        payload = pickle.dumps(
            _Outcome(
                rank,
                False,
                exc_type=type(exc).__name__,
                message=f"result could not be pickled: {exc}",
                traceback=traceback.format_exc(),
            )
        )
        ok = False
    results.put(payload)
    if ok:
        shutdown_distributed()
    elif dist.is_initialized():
        # A failed rank must not wait in a barrier for peers that will never come.
        dist.destroy_process_group()
    results.close()
    results.join_thread()


def run_on_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
    start_method: str | None = None,
    env: Mapping[str, str] | None = None,
    threads_per_rank: int = 1,
    setup_distributed: bool = True,
    collective_timeout_minutes: float = 2.0,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` processes; return the values by rank.

    Raises ``RankFailedError`` naming the first failing rank with its traceback (every
    other rank is killed), or, after ``timeout`` seconds, naming the ranks still running
    with their Python stacks.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    method = start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    if method == "fork":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # forked ranks would inherit the parent's live connections and threads
            raise DistributedError(
                "cannot fork ranks: this process already has a torch.distributed process "
                "group (an earlier meshtrain.initialize, Accelerator() or "
                "init_process_group here, e.g. in another notebook cell). Call "
                "torch.distributed.destroy_process_group() first, keep that setup inside "
                "the function you launch, or pass start_method='spawn'"
            )
    ctx = mp.get_context(method)
    for attempt in range(PORT_TRIES):
        try:
            return _run_group(
                ctx, fn, nprocs, args, kwargs, timeout, env, threads_per_rank,
                setup_distributed, collective_timeout_minutes,
            )  # fmt: skip
        except RankFailedError as exc:
            if not (exc.port_taken and attempt + 1 < PORT_TRIES):
                raise
    raise AssertionError("unreachable")


def _run_group(
    ctx, fn, nprocs, args, kwargs, timeout, env, threads, setup_distributed, pg_minutes
) -> list[Any]:
    """One try of :func:`run_on_ranks` on a fresh free port."""
    results = ctx.Queue()
    started = ctx.Barrier(nprocs)
    port = free_port()
    stack_dir = tempfile.mkdtemp(prefix="meshtrain-stacks-")
    stack_files = [os.path.join(stack_dir, f"rank{r}.txt") for r in range(nprocs)]
    procs = []
    with heap_frozen():
        for rank in range(nprocs):
            p = ctx.Process(
                target=_child,
                args=(
                    fn,
                    rank,
                    nprocs,
                    port,
                    tuple(args),
                    dict(kwargs or {}),
                    {"MESHTRAIN_DOCTOR_DIR": stack_dir, **(env or {})},
                    threads,
                    setup_distributed,
                    pg_minutes,
                    stack_files[rank],
                    results,
                    started,
                ),
                name=f"meshtrain-rank{rank}",
                daemon=False,
            )
            p.start()
            procs.append(p)

    values: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        return _collect(procs, results, values, nprocs, deadline, stack_files, timeout)
    except RankFailedError as exc:
        table = _doctor_table(stack_dir, nprocs)
        if table:
            exc.args = (f"{exc.args[0]}\n{table}",)
        raise
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
        shutil.rmtree(stack_dir, ignore_errors=True)


def _doctor_table(folder: str, nprocs: int) -> str:
    from meshtrain.distributed.doctor import diagnose, read_folder

    records, _pids = read_folder(folder)
    return diagnose(records, nprocs).table() if records else ""


def _collect(procs, results, values, nprocs, deadline, stack_files, timeout) -> list[Any]:
    """The parent's loop: gather each rank's outcome; raise on a failure or timeout."""
    while len(values) < nprocs:
        try:
            out: _Outcome = pickle.loads(results.get(timeout=0.2))
        except queue.Empty:
            dead = [
                (r, p.exitcode)
                for r, p in enumerate(procs)
                if r not in values and p.exitcode is not None
            ]
            if dead:
                # a rank that exited without a report may still have one in flight
                try:
                    out = pickle.loads(results.get(timeout=1.0))
                except queue.Empty:
                    r, code = dead[0]
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    raise RankFailedError(
                        f"rank {r} died with {how} before reporting a result", rank=r
                    ) from None
            elif deadline is not None and time.monotonic() > deadline:
                raise _timeout_error(procs, values, stack_files, timeout) from None
            else:
                continue
        if not out.ok:
            exc = RankFailedError(
                f"rank {out.rank} raised {out.exc_type}: {out.message}\n"
                f"--- traceback from rank {out.rank} ---\n{out.traceback}",
                rank=out.rank,
                exc_type=out.exc_type,
            )
            exc.port_taken = out.stage == "init" and _port_in_use(out.message)
            raise exc
        values[out.rank] = out.value
    for p in procs:
        p.join(timeout=60)
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RankFailedError(f"ranks finished but exited uncleanly: {bad}", rank=bad[0][0])
    return [values[r] for r in range(nprocs)]


def _wait_for_stacks(paths: list[str], bound_s: float) -> None:
    """Until each file is non-empty and its size held still for 0.2 s, or ``bound_s``."""
    deadline = time.monotonic() + bound_s
    last: list[int] = []
    while time.monotonic() < deadline:
        sizes = [os.path.getsize(p) if os.path.exists(p) else 0 for p in paths]
        if all(sizes) and sizes == last:
            return
        last = sizes
        time.sleep(0.2)


def _timeout_error(procs, values, stack_files, timeout) -> RankFailedError:
    alive = [r for r, p in enumerate(procs) if r not in values and p.is_alive()]
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    # faulthandler writes from the signal handler once the rank is next scheduled, which
    # on a loaded machine can take longer than any fixed sleep: wait for every file to
    # have content that stopped growing (or for the bound)
    _wait_for_stacks([stack_files[r] for r in alive], STACKS_WAIT_S)
    parts = []
    for r in alive:
        with open(stack_files[r]) as f:
            parts.append(f"--- Python stacks of rank {r} ---\n{f.read().strip()}")
    return RankFailedError(
        f"ranks {alive} did not finish within {timeout:g} s (hang or deadlock?)\n"
        + "\n".join(parts),
        rank=alive[0] if alive else None,
    )
