"""DeepSpeed-style hostfiles, ``--include``/``--exclude`` filters, and the multi-node fan-out.

A hostfile has one node per line, ``hostname slots=N`` (N = GPUs, or processes, on it);
``#`` starts a comment. The filters use DeepSpeed's syntax: ``host1@host2:0,2`` means all
slots of ``host1`` and slots 0 and 2 of ``host2``. ``--include`` keeps only what it names,
``--exclude`` removes it (a bare host removes the whole node).

The fan-out starts one ``meshtrain launch`` agent per node with that node's rank, the
first node as master (static rendezvous, like DeepSpeed's launcher), waits for all, and
returns the first failing node's exit code: once one node fails the others are stopped, so
their codes only echo that first failure. Nodes that are this machine run as plain
subprocesses; the others over ``ssh`` (key-based: ``BatchMode`` makes a password prompt an
error instead of a hang). Every node's agent runs under :mod:`meshtrain.launch.tether`,
whose stdin is a pipe from this launcher (through ssh for a remote node): when the pipe
ends -- the launcher stops the job, is interrupted, or dies, or the ssh session drops --
the tether stops the agent and kills what is left of its ranks, so no node keeps orphans.
The runner is a parameter so tests can inspect the exact command lines without ssh.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from meshtrain.distributed.env import DEFAULT_MASTER_PORT
from meshtrain.errors import ConfigError
from meshtrain.files.text import decode
from meshtrain.launch.failure import exit_code
from meshtrain.launch.launcher import LaunchSpec, spec_flags
from meshtrain.launch.tether import descendants

# environment forwarded to remote nodes (ssh does not carry the caller's environment)
EXPORT_PREFIXES = (
    "NCCL_", "GLOO_", "TORCH_", "MESHTRAIN_", "PYTHON", "HF_", "TRANSFORMERS_",
    "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS", "UCX_", "FI_",
)  # fmt: skip
# KEY=VALUE files (DeepSpeed's .deepspeed_env included) forwarded to every remote node
ENV_FILES = (".meshtrain_env", ".deepspeed_env")
_LINE = re.compile(r"(\S+)\s+slots\s*=\s*(\d+)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what a host name, IPv4/IPv6 address or ssh ``user@host`` can hold; anything else (and a
# leading "-", which ssh would read as an option: CVE-2017-1000117's pattern) is refused
_HOST = re.compile(r"[A-Za-z0-9_.:%\[\]@-]+")


def parse_hostfile(path: str | os.PathLike) -> dict[str, int]:
    """Read ``hostname slots=N`` lines into ``{host: slots}`` in file order."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path}: cannot read it ({exc.strerror})") from None
    # the one reading path: a BOM is dropped, UTF-16, invalid bytes and 0 bytes are named
    lines = decode(
        raw,
        str(path),
        ConfigError,
        what="hostfile",
        empty_fix="write one 'hostname slots=N' line per node",
    ).splitlines()
    hosts: dict[str, int] = {}
    first: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if not match:
            raise ConfigError(
                f"{path}:{number}: {raw.strip()!r} is not 'hostname slots=N' "
                "(e.g. 'worker-1 slots=8')"
            )
        host, slots = match.group(1), int(match.group(2))
        if host.startswith("-") or not _HOST.fullmatch(host):
            raise ConfigError(
                f"{path}:{number}: {host!r} is not a host name (a name may hold letters, "
                "digits, '.', '-', '_', ':' and '@', and may not start with '-', which ssh "
                "would take for an option); fix the line"
            )
        if host in hosts:
            raise ConfigError(
                f"{path}:{number}: host {host!r} is listed twice (first at line "
                f"{first[host]}); keep one line per node"
            )
        if slots < 1:
            raise ConfigError(f"{path}:{number}: {host} has slots={slots}; need at least 1")
        hosts[host], first[host] = slots, number
    if not hosts:
        raise ConfigError(f"{path}: no 'hostname slots=N' lines found")
    return hosts


def parse_filter(spec: str, flag: str = "--include") -> dict[str, list[int] | None]:
    """Parse ``host1@host2:0,2`` into ``{"host1": None, "host2": [0, 2]}`` (None = all)."""
    out: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, _, slots = part.strip().partition(":")
        if not host or (":" in part and not slots):
            raise ConfigError(f"{flag} {spec!r}: expected host or host:slot,slot joined by @")
        try:
            out[host] = sorted({int(s) for s in slots.split(",")}) if slots else None
        except ValueError:
            raise ConfigError(f"{flag} {spec!r}: slots of {host!r} must be integers") from None
    return out


def filter_hosts(
    hosts: Mapping[str, int], include: str | None = None, exclude: str | None = None
) -> dict[str, list[int]]:
    """Apply ``--include`` or ``--exclude`` to ``{host: slots}``; return ``{host: slot list}``."""
    if include and exclude:
        raise ConfigError("--include and --exclude cannot be used together; pick one")
    active = {host: list(range(n)) for host, n in hosts.items()}
    flag = "--include" if include else "--exclude"
    chosen = parse_filter(include or exclude, flag) if (include or exclude) else {}
    for host, slots in chosen.items():
        if host not in active:
            raise ConfigError(
                f"{flag} names {host!r}, which is not in the hostfile (hosts: {', '.join(active)})"
            )
        bad = [s for s in slots or () if s >= hosts[host]]
        if bad:
            raise ConfigError(f"{host} has slots 0..{hosts[host] - 1}; no slot {bad[0]}")
    if include:
        active = {h: (chosen[h] or s) for h, s in active.items() if h in chosen}
    elif exclude:
        for host, slots in chosen.items():
            active[host] = [] if slots is None else [s for s in active[host] if s not in slots]
        active = {h: s for h, s in active.items() if s}
    if not active:
        raise ConfigError("the --include/--exclude filter leaves no host to run on")
    return active


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (so it needs no ssh): a loopback name, this
    machine's host name, or an address of one of its interfaces (a hostfile that lists
    nodes by address names this node by its own address)."""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    return host in names or _is_own_address(host.rpartition("@")[2])


def _is_own_address(host: str) -> bool:
    # binding succeeds only to an address this machine (this network namespace) holds;
    # names are not resolved here: a slow DNS must not delay the launch
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        socket.inet_pton(family, host.strip("[]"))
    except OSError:
        return False
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host.strip("[]"), 0))
        except OSError:
            return False
    return True


@dataclass
class NodeCommand:
    """One node's agent: the full command line to run here, and extra environment."""

    host: str
    node_rank: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # for local nodes; ssh inlines it
    remote: bool = False  # started over ssh


class Process(Protocol):
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


Runner = Callable[[NodeCommand], Process]


def _env_file_vars() -> dict[str, str]:
    found: dict[str, str] = {}
    for folder in (os.path.expanduser("~"), os.getcwd()):  # the job's folder wins
        for name in ENV_FILES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path) as f:
                    for line in f:
                        key, sep, value = line.strip().partition("=")
                        if sep and _NAME.fullmatch(key.strip()):  # skips comments
                            found[key.strip()] = value.strip()
    return found


def exported_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a remote node gets: prefixes in ``EXPORT_PREFIXES`` and env files."""
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    out.update(_env_file_vars())
    return out


def node_commands(
    resources: Mapping[str, list[int]],
    spec: LaunchSpec,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    ssh_port: int | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
    python: str | None = None,
) -> list[NodeCommand]:
    """Each node's ``meshtrain launch`` command (over ssh unless the node is this machine)."""
    environ = os.environ if environ is None else environ
    hosts = list(resources)
    cwd = cwd or os.getcwd()
    python = python or sys.executable
    all_local = all(is_local(h) for h in hosts)
    if master_addr is None:
        # remote nodes cannot reach "localhost": name this machine instead (by the
        # hostfile's own name for it when that is not a loopback name)
        first = hosts[0].rpartition("@")[2]
        loopback = first in ("localhost", "::1") or first.startswith("127.")
        master_addr = "127.0.0.1" if all_local else (socket.gethostname() if loopback else first)
    port = master_port or DEFAULT_MASTER_PORT
    remote_env = exported_env(environ)
    commands = []
    for rank, host in enumerate(hosts):
        slots = resources[host]
        node = spec.replace(
            nproc_per_node=str(len(slots)), nnodes=str(len(hosts)), node_rank=rank,
            master_addr=master_addr, master_port=port, standalone=False,
        )  # fmt: skip
        # every agent runs tethered to this launcher: when it stops or dies, so does the
        # node's agent and its ranks (meshtrain.launch.tether)
        argv = [python, "-u", "-m", "meshtrain.launch.tether", "--",
                python, "-u", "-m", "meshtrain", "launch", *spec_flags(node), "--",
                spec.script, *spec.script_args]  # fmt: skip
        env = {}
        if slots != list(range(len(slots))):  # a subset of the GPUs was chosen
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        if is_local(host):
            commands.append(NodeCommand(host, rank, argv, env))
            continue
        assignments = [f"{k}={shlex.quote(v)}" for k, v in {**remote_env, **env}.items()]
        env_prefix = f"env {' '.join(assignments)} " if assignments else ""
        remote = f"cd {shlex.quote(cwd)} && exec {env_prefix}{shlex.join(argv)}"
        ssh = ["ssh", "-o", "BatchMode=yes", *(["-p", str(ssh_port)] if ssh_port else [])]
        commands.append(NodeCommand(host, rank, [*ssh, host, remote], remote=True))
    return commands


def popen_runner(command: NodeCommand) -> subprocess.Popen:
    """Start one node's command here (``ssh`` itself for remote nodes).

    Its stdin is a pipe this process holds and never writes: the node's tether stops the
    agent when the pipe ends (closed by :func:`run_nodes`, or by the kernel when this
    process dies; through ssh for a remote node)."""
    return subprocess.Popen(command.argv, env={**os.environ, **command.env}, stdin=subprocess.PIPE)


def run_nodes(
    commands: list[NodeCommand], runner: Runner = popen_runner, grace_s: float = 10.0
) -> int:
    """Start every node, wait for all; on the first failure stop the rest. Return its code.

    Stopping is needed, not just tidy: torchrun's agents whose workers succeeded wait in
    an exit barrier for the failed node, up to 5 minutes, deaf to SIGTERM while blocked
    in it (its workers are gone by then), so a node still running ``grace_s`` after
    SIGTERM is killed. An agent with live workers handles SIGTERM at once and stops them.
    Each node is stopped through its tether (:mod:`meshtrain.launch.tether`): closing its
    channel makes the tether there -- over ssh for a remote node -- stop the agent and
    kill whatever of it and its ranks is left after the tether's grace.
    """
    procs = [(cmd, runner(cmd)) for cmd in commands]
    first_failure: tuple[NodeCommand, int] | None = None
    try:
        pending = list(procs)
        while pending:
            for cmd, proc in list(pending):
                code = proc.poll()
                if code is None:
                    continue
                pending.remove((cmd, proc))
                if code != 0 and first_failure is None:
                    first_failure = (cmd, code)
                    _stop([p for _, p in pending], grace_s)
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop([p for _, p in procs], grace_s)
        return 130
    if first_failure is None:
        return 0
    cmd, code = first_failure
    print(
        f"meshtrain launch: node {cmd.node_rank} ({cmd.host}) exited with code "
        f"{exit_code(code)}; the other nodes were stopped",
        file=sys.stderr,
    )
    return exit_code(code)


def _stop(procs: list[Process], grace_s: float) -> None:
    # closing a node's channel tells its tether (remote ones through ssh) to stop the
    # agent and its ranks there; SIGTERM for a process without one; SIGKILL only when a
    # node has not ended in time (its tether still kills its ranks when ssh goes)
    for proc in procs:
        channel = getattr(proc, "stdin", None)
        if channel is not None and not channel.closed:
            try:
                channel.close()
            except OSError:
                pass
        elif proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            # a local node's agent and ranks below its tether go too (for an ssh node
            # this is the client alone: its remote tether sees the session end)
            for pid in descendants(proc.pid) if hasattr(proc, "pid") else ():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.kill()
            proc.wait()
