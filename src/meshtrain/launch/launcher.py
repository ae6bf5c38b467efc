"""One node's launch: meshtrain's options -> ``torch.distributed.run`` (the elastic agent).

``meshtrain launch`` does not start workers itself. It resolves what the user asked for
(flags, the SLURM allocation, the number of GPUs) into a :class:`LaunchSpec`, turns that
into torchrun's own arguments and calls ``torch.distributed.run.run`` in this process, so
this process *is* the node's elastic agent: it sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` for every worker, restarts the group up to
``max_restarts`` times, and stops every worker as soon as one fails.

Choices made here (and why):

* Processes per node default to the number of CUDA devices, else 1 with a notice, because
  a CPU job silently using one process is the most common "why is it not parallel?".
* ``--rdzv_endpoint`` without ``--rdzv_backend`` means ``c10d`` (torchrun's own default,
  ``static``, would ignore the elastic range and need node ranks).
* A single-node run with no port chosen gets torchrun's ``c10d`` rendezvous on a free
  port, so two jobs on one machine do not collide on 29500.
* The exit code is the job's: the culprit's code (``128 + signal`` for a worker killed
  by a signal), not torchrun's blanket 1. The culprit is the hang doctor's (a rank that
  raised outside a collective, left early, or never entered the collective its peers
  waited in; on any node), else the first failure torch saw
  (:mod:`meshtrain.launch.failure`).
* On a failure the launcher prints the hang doctor's table (every rank's last completed
  collective, the one it waits in, its sequence number, a verdict) and writes it as
  ``doctor.json`` into the run's output folder (``MESHTRAIN_RUN_DIR``, which
  ``meshtrain train`` sets) or the doctor folder. The workers publish their ledgers to
  the rendezvous store (every node's ranks) and into a fresh folder named by
  ``MESHTRAIN_DOCTOR_DIR`` (this node's; :mod:`meshtrain.distributed.ledger`).
* A worker found stopped (``SIGSTOP``, state ``T``) after a peer failed is killed at once:
  it cannot take a ``SIGTERM``, and the agent would otherwise wait out its grace period.
* When a worker has failed, the others are not stopped while they may still leave on
  their own (a rank whose collective failed because of that peer says so in one line
  first), for at most 10 s: :mod:`meshtrain.launch.agent`.
* ``SIGTERM`` and ``SIGUSR1`` are relayed to the workers, which save at the next step and
  exit with 75; the launcher then says ``pre-empted, checkpoint saved at step N`` and
  exits with 75 (:mod:`meshtrain.launch.preemption`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshtrain.distributed.env import DEFAULT_MASTER_PORT, expand_slurm_nodelist
from meshtrain.distributed.ledger import DOCTOR_DIR_ENV
from meshtrain.errors import ConfigError
from meshtrain.launch.agent import patient_agent, process_state
from meshtrain.launch.failure import report_failure
from meshtrain.launch.preemption import TORCH_SIGNALS, SignalRelay

_NPROC_WORDS = ("auto", "gpu", "cpu", "xpu")
MONITOR_INTERVAL_S = 1.0  # meshtrain launch's default --monitor_interval (torchrun: 0.1)


@dataclass
class LaunchSpec:
    """What one node's agent runs; every field mirrors the torchrun flag of the same name."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: str | None = None  # int as text, or auto/gpu/cpu; None -> GPUs else 1
    nnodes: str = "1"  # "N" or an elastic range "MIN:MAX"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    local_addr: str | None = None
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float | None = None
    start_method: str | None = None
    module: bool = False
    no_python: bool = False
    log_dir: str | None = None
    redirects: str | None = None
    tee: str | None = None

    def replace(self, **changes) -> LaunchSpec:
        return dataclasses.replace(self, **changes)


def validate_nproc(value: str) -> str:
    """Accept a positive integer or one of torchrun's words; raise ConfigError otherwise."""
    if value in _NPROC_WORDS or (value.isdigit() and int(value) > 0):
        return value
    raise ConfigError(
        f"--nproc_per_node={value!r}: expected a positive integer or one of {_NPROC_WORDS}"
    )


def validate_nnodes(value: str) -> str:
    """Accept ``N`` or ``MIN:MAX`` (an elastic range, needs a c10d rendezvous)."""
    if re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", value):
        lo, _, hi = value.partition(":")
        if not hi or int(lo) <= int(hi):
            return value
    raise ConfigError(f"--nnodes={value!r}: expected N or MIN:MAX with 1 <= MIN <= MAX")


def max_nodes(spec: LaunchSpec) -> int:
    return int(spec.nnodes.rpartition(":")[2])


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA).

    ``device_count`` asks NVML where it can and does not create a CUDA context, so a
    later fork (``notebook_launcher``) stays safe; ``is_available`` gives no such promise.
    """
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken driver should not stop a CPU launch
        return 0


def default_nproc_per_node(gpus: int | None = None) -> tuple[str, str | None]:
    """Processes per node when none were asked for, and the notice to print (or None)."""
    gpus = gpu_count() if gpus is None else gpus
    if gpus > 0:
        return str(gpus), None
    return "1", (
        "meshtrain launch: no GPU found, running 1 CPU process per node "
        "(ask for more with --nproc_per_node N)"
    )


def slurm_node(environ: Mapping[str, str]) -> dict | None:
    """nnodes, node_rank, master_addr and master_port from a SLURM step, or None.

    Only used when the user gave none of those flags. Expects one ``meshtrain launch`` per
    node (``srun --ntasks-per-node=1 meshtrain launch ...``). The port is derived from the
    job id so two jobs sharing a node do not both take 29500; ``MASTER_PORT`` wins.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or "SLURM_NNODES" not in environ or "SLURM_NODEID" not in environ:
        return None
    hosts = expand_slurm_nodelist(nodelist)
    try:
        nnodes, node_rank = int(environ["SLURM_NNODES"]), int(environ["SLURM_NODEID"])
    except ValueError:
        raise ConfigError(
            f"SLURM_NNODES={environ['SLURM_NNODES']!r} / SLURM_NODEID="
            f"{environ['SLURM_NODEID']!r} are not integers"
        ) from None
    if nnodes != len(hosts):
        raise ConfigError(
            f"SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} "
            "hosts; pass --nnodes/--node_rank/--master_addr explicitly"
        )
    if "MASTER_PORT" in environ:
        port = int(environ["MASTER_PORT"])
    else:
        job = environ.get("SLURM_JOB_ID", "")
        port = DEFAULT_MASTER_PORT + (int(job) % 1000 if job.isdigit() else 0)
    return {
        "nnodes": str(nnodes),
        "node_rank": node_rank,
        "master_addr": hosts[0],
        "master_port": port,
    }


def resolve(
    spec: LaunchSpec, environ: Mapping[str, str] | None = None, gpus: int | None = None
) -> tuple[LaunchSpec, list[str]]:
    """Fill the defaults (SLURM, processes per node, rendezvous); return it and notices."""
    environ = os.environ if environ is None else environ
    notices: list[str] = []
    explicit = spec.nnodes != "1" or spec.node_rank or spec.master_addr or spec.rdzv_endpoint
    if not explicit and not spec.standalone:
        slurm = slurm_node(environ)
        if slurm and int(slurm["nnodes"]) > 1:
            spec = spec.replace(
                **{**slurm, "master_port": spec.master_port or slurm["master_port"]}
            )
            notices.append(
                f"meshtrain launch: SLURM allocation, node {spec.node_rank} of {spec.nnodes}, "
                f"master {spec.master_addr}:{spec.master_port}"
            )
    if spec.nproc_per_node is None:
        nproc, notice = default_nproc_per_node(gpus)
        spec = spec.replace(nproc_per_node=nproc)
        if notice:
            notices.append(notice)
    if spec.rdzv_endpoint and not spec.rdzv_backend:
        spec = spec.replace(rdzv_backend="c10d")
    if max_nodes(spec) > 1 and not (spec.rdzv_endpoint or spec.master_addr):
        raise ConfigError(
            f"--nnodes={spec.nnodes} needs a meeting point: --master_addr (and --master_port) "
            "of node 0, --rdzv_endpoint HOST:PORT, or --hostfile"
        )
    if ":" in spec.nnodes and (spec.rdzv_backend or "static") == "static":
        raise ConfigError(
            f"--nnodes={spec.nnodes} is an elastic range; it needs --rdzv_backend c10d "
            "and --rdzv_endpoint HOST:PORT"
        )
    return spec, notices


def spec_flags(spec: LaunchSpec) -> list[str]:
    """The options (not the script) as flags both torchrun and ``meshtrain launch`` accept."""
    flags: list[str] = []
    for name in (
        "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port",
        "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "local_addr", "max_restarts",
        "monitor_interval", "start_method", "log_dir", "redirects", "tee",
    ):  # fmt: skip
        value = getattr(spec, name)
        # a single node at rank 0 is torchrun's default; leaving it out keeps its
        # free-port c10d rendezvous for single-node runs
        if value is None or (name, str(value)) in (("nnodes", "1"), ("node_rank", "0")):
            continue
        flags += [f"--{name}", str(value)]
    flags += [f"--{name}" for name in ("standalone", "module", "no_python") if getattr(spec, name)]
    return flags


def torchrun_command(spec: LaunchSpec) -> str:
    """The equivalent ``torchrun`` command line (what ``--dry_run`` prints)."""
    return shlex.join(["torchrun", *spec_flags(spec), spec.script, *spec.script_args])


def run_agent(spec: LaunchSpec) -> int:
    """Run this node's elastic agent until the job ends; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    # "--" keeps a script whose name starts with "-" from being read as a flag; the
    # script's own arguments are set afterwards so argparse never touches them.
    if not (spec.module or spec.no_python) and not os.path.isfile(spec.script):
        raise ConfigError(
            f"SCRIPT {spec.script!r} does not exist (looked in {os.getcwd()}); check the "
            "path, or pass -m to run a module"
        )
    args = get_args_parser().parse_args([*spec_flags(spec), "--", spec.script])
    args.training_script_args = list(spec.script_args)
    if spec.monitor_interval is None:
        # torchrun checks its workers every 0.1 s; once a second is plenty now that the
        # agent waits for survivors to leave on their own (meshtrain.launch.agent)
        args.monitor_interval = MONITOR_INTERVAL_S
    own_dir = DOCTOR_DIR_ENV not in os.environ
    doctor_dir = os.environ.get(DOCTOR_DIR_ENV) or tempfile.mkdtemp(prefix="meshtrain-doctor-")
    os.environ[DOCTOR_DIR_ENV] = doctor_dir  # the workers inherit it
    watcher = _StopWatcher(doctor_dir)
    watcher.start()
    note = os.path.join(doctor_dir, "preempted.json")
    if os.path.exists(note):
        os.remove(note)  # a note from an earlier job in a folder the user gave
    relay = SignalRelay(note).install()  # SIGTERM/SIGUSR1 -> the workers save, exit 75
    args.signals_to_handle = TORCH_SIGNALS  # torch's agent leaves SIGTERM to the relay
    keep = False
    try:
        with patient_agent(relay):
            run(args)
        preempted = relay.report()
        if preempted is not None:
            return preempted
    except ChildFailedError as exc:
        code, keep = report_failure(exc, doctor_dir, watcher.stopped)
        return code
    except RendezvousError as exc:
        _raise_if_port_in_use(exc, spec)
        print(f"meshtrain launch: rendezvous failed: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # torch's DistNetworkError, raised while binding the store
        _raise_if_port_in_use(exc, spec)
        raise
    except SignalException as exc:
        print(f"meshtrain launch: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        relay.uninstall()
        watcher.stop()
        if own_dir:
            os.environ.pop(DOCTOR_DIR_ENV, None)
            if not keep:
                shutil.rmtree(doctor_dir, ignore_errors=True)
    return 0


def _raise_if_port_in_use(exc: BaseException, spec: LaunchSpec) -> None:
    """EADDRINUSE from the rendezvous store: one clear line instead of torch's traceback."""
    text = f"{exc} {exc.__cause__ or ''}"
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return
    port = spec.master_port or (spec.rdzv_endpoint or "").rpartition(":")[2] or "?"
    flag = "--master_port" if spec.master_port else "--rdzv_endpoint"
    raise ConfigError(
        f"port {port} is already in use on this machine (another job, or one that has not "
        f"exited yet); pick a free port with {flag}, or leave it out on a single node and "
        "meshtrain launch picks a free one"
    ) from None


class _StopWatcher(threading.Thread):
    """Kills a worker that is stopped (SIGSTOP) once a peer has failed; notes which.

    A stopped process holds its SIGTERM until it is continued, so the agent would wait out
    its whole grace period; continuing it instead would let it run into collectives its
    peers already left, and blur the doctor's picture.
    """

    def __init__(self, folder: str) -> None:
        super().__init__(name="meshtrain-stop-watcher", daemon=True)
        self.folder = folder
        self.stopped: dict[int, str] = {}
        self._done = threading.Event()

    def run(self) -> None:
        from meshtrain.distributed.doctor import read_folder

        while not self._done.wait(0.5):
            records, pids = read_folder(self.folder)
            if not any(r.get("reason") in ("error", "exception") for r in records.values()):
                continue
            for rank, pid in pids.items():
                if rank not in self.stopped and process_state(pid) == "T":
                    self.stopped[rank] = "stopped (SIGSTOP), killed by the launcher"
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def stop(self) -> None:
        self._done.set()
