"""Where this process sits in the job: rank, world, device, backend; and process-group life.

Sources, in order:

1. torchrun / ``meshtrain launch``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
2. SLURM (``srun`` without torchrun): ``SLURM_PROCID``, ``SLURM_NTASKS``,
   ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``, and the master
   address is the first host of ``SLURM_NODELIST`` (``SLURM_JOB_NODELIST``).
3. Nothing: a plain ``python script.py`` is a world of one. No ``MASTER_ADDR`` is needed;
   the process group of size 1 uses an in-memory store.

The device is ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``; the backend follows
(nccl / gloo). ``init_distributed`` is idempotent and sets a collective timeout (minutes,
not torch's 30-minute default) so a dead peer surfaces as an error instead of a hang.
``shutdown_distributed`` tears the group down in order (barrier, then destroy), which is
what keeps gloo from aborting at interpreter exit ("terminate called without an active
exception") after a successful run.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.distributed.rank_records import attempt
from meshtrain.distributed.timeouts import creation_timeout_minutes
from meshtrain.errors import DistributedError

DEFAULT_TIMEOUT_MINUTES = 5.0
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, read from the environment (see module docstring)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun", "slurm" or "single"

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @property
    def device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        """``nccl`` for CUDA devices, ``gloo`` for CPU."""
        return "nccl" if self.device.type == "cuda" else "gloo"


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ[key]
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {key}={value!r} is not an integer") from None


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``gpu[01-03,07],cpu5`` into host names.

    >>> expand_slurm_nodelist("node[1-3,5],login")
    ['node1', 'node2', 'node3', 'node5', 'login']
    """
    hosts: list[str] = []
    # split on commas that are not inside brackets
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous address from torchrun's or SLURM's variables."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = _int(environ, "WORLD_SIZE")
        port = environ.get("MASTER_PORT")
        return DistEnv(
            rank=_int(environ, "RANK"),
            world_size=world,
            local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE")
            if "LOCAL_WORLD_SIZE" in environ
            else world,
            master_addr=environ.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
            source="torchrun",
        )
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        nodelist = environ.get("SLURM_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        hosts = expand_slurm_nodelist(nodelist) if nodelist else []
        per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        local_world = int(re.match(r"\d+", per_node).group()) if per_node else 1
        port = environ.get("MASTER_PORT")
        return DistEnv(
            rank=_int(environ, "SLURM_PROCID"),
            world_size=_int(environ, "SLURM_NTASKS"),
            local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
            local_world_size=local_world,
            master_addr=environ.get("MASTER_ADDR") or (hosts[0] if hosts else None),
            master_port=int(port) if port else DEFAULT_MASTER_PORT,
            source="slurm",
        )
    return DistEnv(0, 1, 0, 1, None, None, "single")


def init_distributed(
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
    backend: str | None = None,
    environ: Mapping[str, str] | None = None,
    first_step_timeout_minutes: float | None = None,
) -> DistEnv:
    """Initialise the default process group once; later calls return the same ``DistEnv``.

    ``timeout_minutes`` bounds every collective so a dead or stuck peer raises instead of
    hanging for torch's default 30 minutes; with ``first_step_timeout_minutes`` the group
    starts with that longer bound until the first step ends (:mod:`.timeouts`). With no launcher environment this is a world of
    size 1 on an in-memory store (no ``MASTER_ADDR`` needed).
    """
    env = read_env(environ)
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise DistributedError(
                f"a process group of size {dist.get_world_size()} already exists but the "
                f"environment says WORLD_SIZE={env.world_size}"
            )
        _check_existing(backend, first_step_timeout_minutes)
        return env
    backend = backend or env.backend
    minutes = creation_timeout_minutes(timeout_minutes, first_step_timeout_minutes)
    timeout = timedelta(minutes=minutes)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if env.world_size == 1 and env.master_addr is None:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    else:
        if env.master_addr is None:
            raise DistributedError(
                f"rank {env.rank} of {env.world_size} has no MASTER_ADDR; start the job "
                "with `meshtrain launch` or torchrun, or export MASTER_ADDR and MASTER_PORT"
            )
        init_method = f"tcp://{_host(env.master_addr)}:{env.master_port or DEFAULT_MASTER_PORT}"
        store = _attempt_store(environ if environ is not None else os.environ, env, timeout)
        if store is not None:
            init_method = None
        elif env.source == "torchrun":
            init_method = "env://"
        dist.init_process_group(
            backend,
            init_method=init_method,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    atexit.register(_shutdown_at_exit)
    return env


def join_group(distributed: Any) -> DistEnv:
    """Join the default process group as a config's ``distributed`` section says
    (``backend``, ``timeout_minutes``, ``first_step_timeout_minutes``): the one door every
    front door takes, so that no key of the section is dropped on the way."""
    return init_distributed(
        timeout_minutes=distributed.timeout_minutes,
        backend=None if distributed.backend == "auto" else distributed.backend,
        first_step_timeout_minutes=distributed.first_step_timeout_minutes,
    )


def _check_existing(backend: str | None, first_step_timeout_minutes: float | None) -> None:
    """A process group made before (by torch, a launcher, an earlier engine) is kept: a
    backend other than its own is refused by name, and a first-step timeout it was not
    made with is said to do nothing (a group's creation timeout is what bounds the first
    step's collectives)."""
    have = dist.get_backend()
    if backend is not None and backend != have:
        raise DistributedError(
            f"distributed.backend {backend}: the process group already exists with {have} "
            f"(made before this config was read); set distributed.backend to {have} or "
            '"auto", or let meshtrain make the group with this config'
        )
    if first_step_timeout_minutes is not None:
        from meshtrain.distributed.store_io import pg_timeout_seconds

        made = pg_timeout_seconds()
        if made is not None and made < first_step_timeout_minutes * 60:
            warnings.warn(
                f"distributed.first_step_timeout_minutes {first_step_timeout_minutes:g} does "
                f"nothing here: the process group already exists with a {made / 60:g} min "
                "timeout (made before this config was read); let meshtrain make the group "
                "with this config (meshtrain.initialize / meshtrain launch)",
                stacklevel=3,
            )


def _attempt_store(environ, env: DistEnv, timeout: timedelta):
    """Under torchrun's agent store, a store whose keys are private to this restart.

    The elastic agent keeps one TCPStore for the whole job and torch's ``env://`` does not
    prefix it per restart, so after ``--max-restarts`` brings the workers back, a rank can
    read a peer's gloo address left by the previous attempt and fail with "connectFullMesh
    ... Connection refused" (3 of 5 restarted runs here). Prefixing the keys with the
    attempt (:func:`rank_records.attempt`: the same number on every node) makes every
    attempt start on a clean slate."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        env.master_addr,
        int(env.master_port or DEFAULT_MASTER_PORT),
        env.world_size,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"meshtrain/attempt{attempt(environ)}", client)


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


EXIT_BARRIER_SECONDS = 10.0


def _shutdown_at_exit() -> None:
    """Interpreter-exit teardown that never turns one rank's failure into a long hang.

    After an uncaught exception the peers may be stuck in a collective, so the barrier is
    skipped. Otherwise the ranks meet on the store with a short timeout (a rank that
    called ``sys.exit(n)`` mid-run would leave a collective barrier waiting for the full
    collective timeout); either way the group is then destroyed, which is what keeps
    gloo from aborting at exit. The wait is at most half the collective timeout: a rank
    that leaves mid-run must be gone, with its own exit code, before its peers' collective
    times out, or the launcher would see them fail first and blame the wrong rank.
    """
    if not dist.is_initialized():
        return
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    world = dist.get_world_size()
    if not failed and world > 1:
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.add("meshtrain/exit", 1) == world:
                store.set("meshtrain/exit_done", "1")
            store.wait(["meshtrain/exit_done"], timedelta(seconds=_exit_barrier_seconds()))
        except Exception:  # noqa: BLE001 - a peer is gone; destroy regardless
            pass
    dist.destroy_process_group()


def _exit_barrier_seconds() -> float:
    from meshtrain.distributed.store_io import pg_timeout_seconds

    timeout = pg_timeout_seconds()
    return EXIT_BARRIER_SECONDS if timeout is None else min(EXIT_BARRIER_SECONDS, timeout / 2)


def shutdown_distributed() -> None:
    """Barrier, then destroy the default group: the order that lets gloo exit cleanly.

    Safe to call more than once and when no group exists. The barrier makes sure no peer
    is still inside a collective when its partner's sockets close.
    """
    if not dist.is_initialized():
        return
    try:
        if dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()
