"""A node's agent tied to the hostfile launcher that started it: no orphans on any node.

    python -m meshtrain.launch.tether -- python -m meshtrain launch --node_rank 1 ...

The hostfile launcher (:mod:`meshtrain.launch.hostfile`) starts every node's agent under
this wrapper, locally or as the remote command of ``ssh HOST``, with the wrapper's stdin
a pipe from the launcher (through ssh for a remote node). The launcher never writes to it;
the pipe only *ends*: when the launcher closes it (it stops the job: a failure on another
node, Ctrl-C), when the launcher dies (even ``SIGKILL``: the kernel closes its end), or
when the ssh session dies (the client killed, the link cut: sshd closes the remote end).
That end-of-file is the one signal that crosses ssh reliably -- without a terminal, sshd
sends no ``SIGHUP`` to the remote command, which is why a plain ``ssh HOST agent`` leaves
the agent and its ranks running when the launcher goes.

On end-of-file (or ``SIGTERM``/``SIGINT``/``SIGHUP`` to the wrapper) the agent gets
``SIGTERM`` (its pre-emption path: the workers save at the next step where they can,
:mod:`meshtrain.launch.preemption`) and :data:`GRACE_S` to end; then the agent and every
process below it -- torch starts workers in sessions of their own, so a process group
would miss them: the tree is read from ``/proc`` -- are killed. The wrapper exits with
the agent's code (``128 + N`` for a signal N).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 10.0  # the agent's time to stop its workers itself before everything is killed


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_tree(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """``SIGTERM`` to ``proc``; after ``grace_s``, ``SIGKILL`` to it and all below it."""
    below = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and (proc.poll() is None or _alive(below)):
        below = sorted(set(below) | set(descendants(proc.pid)))
        time.sleep(0.1)
    for pid in [*descendants(proc.pid), *below, proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _alive(pids: list[int]) -> bool:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except (OSError, IndexError):
            continue
    return False


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m meshtrain.launch.tether -- COMMAND ...", file=sys.stderr)
        return 2
    agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    ended = threading.Event()

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        ended.set()

    threading.Thread(target=watch_stdin, name="meshtrain-tether", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: ended.set())
    while agent.poll() is None:
        if ended.wait(0.2):
            print(
                f"meshtrain launch: the launcher's channel closed; stopping this node's "
                f"agent (pid {agent.pid})",
                file=sys.stderr,
                flush=True,
            )
            stop_tree(agent)
            break
    code = agent.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
