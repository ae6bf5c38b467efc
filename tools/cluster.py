"""A cluster of N nodes on this machine: network namespaces, a bridge, an sshd per node.

    python tools/cluster.py up --nodes 2 --dir /tmp/mtc      # prints each node's address
    python tools/cluster.py exec --dir /tmp/mtc 1 -- ip -br addr
    python tools/cluster.py down --dir /tmp/mtc

Each node is a network namespace with its own network stack: one veth link whose far end
is a port of a bridge in the root namespace, an address of a private subnet
(``10.213.0.0/24`` unless another is asked for: node ``i`` is ``.i+1``) on an interface
named ``eth0`` inside every node (so ``GLOO_SOCKET_IFNAME=eth0`` is right everywhere), and
an OpenSSH server listening on that address only. The nodes share this machine's file
system, as a cluster's nodes share a network file system: the checkpoint folder is one
folder. The bridge has no address and there is no route from the root namespace, so the
nodes reach each other and nothing else, and the subnet cannot clash with the machine's.

ssh: a key pair and a host key are made for the cluster in its folder; each sshd accepts
root by that key only (no passwords); the client side is ``DIR/ssh_config`` (the key, a
``known_hosts`` holding each node's host key, so ``StrictHostKeyChecking`` stays on, and
keep-alives that notice a dead link within seconds) and ``DIR/bin/ssh``, a wrapper that
passes it, which a launcher finds first on ``PATH``. Nothing of the user's ``~/.ssh`` is
read or changed.

A fault is what a cluster does to a node: :meth:`Cluster.link` takes its link down or up
(``ip link set eth0 down`` inside the node), :meth:`Cluster.pids` lists every process in
a node (``ip netns pids``), and :meth:`Cluster.popen` runs a command in one.

Everything made is named with a per-cluster tag (several clusters can exist at once) and
recorded in ``DIR/cluster.json``, which ``down`` reads: processes in the namespaces are
killed, the namespaces (and with them their veth ends) and the bridge deleted. The tests
(``tests/multinode``) use this module as a fixture that always tears down, and skip with
the reason when :func:`unavailable` says the machine cannot do it (not root, no
``ip netns``, no ``sshd``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SUBNET = "10.213.0"  # a /24 of RFC 1918 space rarely used by anything else
IFACE = "eth0"  # the interface's name inside every node


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why this machine cannot host a cluster, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if not os.path.exists(SSHD):
        return f"no OpenSSH server ({SSHD}): apt-get install openssh-server"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "no OpenSSH client (ssh, ssh-keygen): apt-get install openssh-client"
    probe = f"mtprobe{secrets.token_hex(3)}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed here: {made.stderr.strip()}"
    _run("ip", "netns", "delete", probe, check=False)
    return None


def _subnet_in_use(subnet: str) -> bool:
    routes = _run("ip", "-4", "route", "show", "table", "all", check=False).stdout
    addrs = _run("ip", "-4", "-o", "addr", check=False).stdout
    return f"{subnet}." in routes or f"{subnet}." in addrs


class Cluster:
    """N nodes as network namespaces joined by a bridge, each with an sshd (module doc)."""

    def __init__(self, nodes: int, folder: str | os.PathLike, subnet: str = SUBNET) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes={nodes}: a cluster has 1 to 200 nodes")
        self.nodes = nodes
        self.dir = Path(folder).resolve()
        self.subnet = subnet
        self.tag = secrets.token_hex(2)
        self.bridge = f"mtb{self.tag}"
        self.namespaces = [f"mt{self.tag}n{i}" for i in range(nodes)]
        self.sshd: list[subprocess.Popen] = []
        self.shared = self.dir / "shared"  # the "network file system" every node sees

    # names and addresses -----------------------------------------------------------------
    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    @property
    def iface(self) -> str:
        return IFACE

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def bin(self) -> Path:
        """A folder whose ``ssh`` uses this cluster's keys; put it first on ``PATH``."""
        return self.dir / "bin"

    def env(self, node: int, base: dict | None = None) -> dict[str, str]:
        """An environment for a process on ``node``: the cluster's ssh first on PATH,
        gloo bound to the node's interface."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["GLOO_SOCKET_IFNAME"] = IFACE
        return env

    # life cycle --------------------------------------------------------------------------
    def up(self) -> Cluster:
        """Make the bridge, the nodes, the keys, and start and wait for every sshd."""
        if _subnet_in_use(self.subnet):
            raise RuntimeError(
                f"{self.subnet}.0/24 is in use on this machine; pick another with --subnet"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shared.mkdir(exist_ok=True)
        self._save()  # first, so that down() finds whatever up() managed to make
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            outer, inner = f"mtv{self.tag}{i}", f"mtp{self.tag}{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "-n", ns, "link", "set", inner, "name", IFACE)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._keys()
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
        for i, ns in enumerate(self.namespaces):
            log = open(self.dir / f"sshd{i}.log", "wb")  # noqa: SIM115 - lives with sshd
            self.sshd.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(self._sshd_config(i))],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        for i in range(self.nodes):
            self._wait_ssh(i)
        return self

    def down(self) -> None:
        """Kill every process in the nodes, delete the namespaces and the bridge."""
        for ns in self.namespaces:
            for _ in range(3):
                pids = _ns_pids(ns)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
        for proc in self.sshd:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for i, ns in enumerate(self.namespaces):
            # deleting a namespace frees its veth pair only once the kernel is done with
            # it; deleting the outer end now makes the teardown complete on return
            _run("ip", "link", "delete", f"mtv{self.tag}{i}", check=False)
            _run("ip", "netns", "delete", ns, check=False)
        _run("ip", "link", "delete", self.bridge, check=False)
        (self.dir / "cluster.json").unlink(missing_ok=True)

    def __enter__(self) -> Cluster:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    # what tests do to nodes --------------------------------------------------------------
    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def popen(self, node: int, argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", self.env(node))
        return subprocess.Popen(self.command(node, argv), **kwargs)

    def pids(self, node: int) -> list[int]:
        """Every process in ``node`` except its sshd listener."""
        listener = {self._sshd_pid(i) for i in range(self.nodes)}
        return [p for p in _ns_pids(self.namespaces[node]) if p not in listener]

    def link(self, node: int, up: bool) -> None:
        """Take ``node``'s network link down (a cut cable) or bring it back up."""
        state = "up" if up else "down"
        _run("ip", "-n", self.namespaces[node], "link", "set", IFACE, state)

    def hostfile(self, slots: int | list[int], path: str | os.PathLike | None = None) -> Path:
        """A DeepSpeed-style hostfile naming every node by address."""
        per = slots if isinstance(slots, list) else [slots] * self.nodes
        path = Path(path or self.dir / "hostfile")
        path.write_text("".join(f"{self.address(i)} slots={n}\n" for i, n in enumerate(per)))
        return path

    # internals ---------------------------------------------------------------------------
    def _save(self) -> None:
        state = {
            "nodes": self.nodes,
            "subnet": self.subnet,
            "tag": self.tag,
            "bridge": self.bridge,
            "namespaces": self.namespaces,
            "addresses": [self.address(i) for i in range(self.nodes)],
        }
        (self.dir / "cluster.json").write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Cluster:
        state = json.loads((Path(folder) / "cluster.json").read_text())
        c = cls(state["nodes"], folder, state["subnet"])
        c.tag, c.bridge, c.namespaces = state["tag"], state["bridge"], state["namespaces"]
        return c

    def _keys(self) -> None:
        d = self.dir
        for name in ("id_ed25519", "host_ed25519"):
            (d / name).unlink(missing_ok=True)
            (d / f"{name}.pub").unlink(missing_ok=True)
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(d / name))
        shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
        host_key = (d / "host_ed25519.pub").read_text().split()[:2]
        (d / "known_hosts").write_text(
            "".join(f"{self.address(i)} {' '.join(host_key)}\n" for i in range(self.nodes))
        )
        (d / "ssh_config").write_text(
            "Host *\n"
            "  User root\n"
            f"  IdentityFile {d / 'id_ed25519'}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {d / 'known_hosts'}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n"
            "  ConnectTimeout 5\n"
            # a cut link ends the session within ~6 s instead of TCP's minutes
            "  ServerAliveInterval 2\n"
            "  ServerAliveCountMax 3\n"
            "  LogLevel ERROR\n"
        )
        self.bin.mkdir(exist_ok=True)
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)

    def _sshd_config(self, node: int) -> Path:
        path = self.dir / f"sshd{node}.conf"
        path.write_text(
            f"ListenAddress {self.address(node)}\n"
            "Port 22\n"
            f"HostKey {self.dir / 'host_ed25519'}\n"
            f"PidFile {self.dir / f'sshd{node}.pid'}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
            "StrictModes no\n"  # the keys live in a temp folder, not ~/.ssh
            "UsePAM no\n"
            "ClientAliveInterval 2\n"
            "ClientAliveCountMax 3\n"
        )
        return path

    def _sshd_pid(self, node: int) -> int | None:
        try:
            return int((self.dir / f"sshd{node}.pid").read_text())
        except (OSError, ValueError):
            return None

    def _wait_ssh(self, node: int, deadline_s: float = 20.0) -> None:
        end = time.monotonic() + deadline_s
        while True:
            # from inside the node: the root namespace has no route to the nodes
            probe = _run(
                *self.command(node, [str(self.bin / "ssh"), self.address(node), "true"]),
                check=False,
            )
            if probe.returncode == 0:
                return
            if time.monotonic() > end or self.sshd[node].poll() is not None:
                log = (self.dir / f"sshd{node}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"node {node}: ssh {self.address(node)} failed: {probe.stderr.strip()}\n{log}"
                )
            time.sleep(0.2)


def _ns_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    up = sub.add_parser("up", help="make the nodes and start their sshd")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--dir", required=True)
    up.add_argument("--subnet", default=SUBNET, help="first three octets of a free /24")
    down = sub.add_parser("down", help="remove everything 'up' made")
    down.add_argument("--dir", required=True)
    ex = sub.add_parser("exec", help="run a command on one node (cluster's ssh on PATH)")
    ex.add_argument("--dir", required=True)
    ex.add_argument("node", type=int)
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.what == "up":
        reason = unavailable()
        if reason:
            print(f"cluster: cannot run here: {reason}", file=sys.stderr)
            return 1
        c = Cluster(args.nodes, args.dir, args.subnet)
        try:
            c.up()
        except BaseException:
            c.down()
            raise
        for proc in c.sshd:  # the sshd outlive this command; 'down' kills them
            proc.returncode = 0
        for i in range(c.nodes):
            print(f"node {i}: {c.address(i)} (netns {c.namespaces[i]}, interface {IFACE})")
        print(f"shared folder: {c.shared}\nssh: PATH={c.bin}:$PATH (or ssh -F {c.ssh_config})")
        return 0
    c = Cluster.load(args.dir)
    if args.what == "down":
        c.down()
        return 0
    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return subprocess.call(c.command(args.node, cmd), env=c.env(args.node))


if __name__ == "__main__":
    sys.exit(_main())
