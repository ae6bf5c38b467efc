"""Multi-node tests on real network namespaces (``tools/cluster.py``): each node its own
network stack, address and sshd; a fault is done to a node as on a cluster (a link taken
down, a node's processes killed or stopped).

Helpers here start one ``meshtrain launch`` per node (or the hostfile launcher on node 0)
and collect what every node printed, its exit code and how long it took.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.launch import clean_env

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "multinode" / "job.py"
MASTER_PORT = 29500  # every cluster has its own network: the default port is free


def cluster_module():
    """``tools/cluster.py`` as a module (tools/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "meshtrain_cluster", REPO / "tools" / "cluster.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("meshtrain_cluster", module)
    spec.loader.exec_module(module)
    return module


@dataclass
class NodeRun:
    node: int
    code: int
    output: str
    seconds: float  # from the start of the job (or of the fault, see ``since``)


def node_env(cluster, node: int, **extra: str) -> dict[str, str]:
    return cluster.env(node, clean_env(**extra))


def start_nodes(cluster, out: Path, nproc: int = 1, launch=(), job=(), nodes=None):
    """One ``meshtrain launch --nnodes N --node_rank I --master_addr NODE0`` per node."""
    n = cluster.nodes
    procs = []
    for i in nodes if nodes is not None else range(n):
        argv = [
            sys.executable, "-u", "-m", "meshtrain", "launch", "--nnodes", str(n),
            "--node_rank", str(i), "--nproc_per_node", str(nproc),
            "--master_addr", cluster.address(0), "--master_port", str(MASTER_PORT),
            *launch, str(JOB), str(out), *job,
        ]  # fmt: skip
        procs.append(
            (
                i,
                cluster.popen(
                    i,
                    argv,
                    env=node_env(cluster, i),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=REPO,
                ),
            )  # fmt: skip
        )
    return procs


def collect(procs, start: float, timeout: float = 300) -> list[NodeRun]:
    """Wait for every node; each one's code, output and seconds since ``start``."""
    runs = []
    for i, p in procs:
        try:
            text, _ = p.communicate(timeout=max(timeout - (time.monotonic() - start), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n[test: node did not exit in time; killed]"
        runs.append(NodeRun(i, p.returncode, text, time.monotonic() - start))
    return runs


def wait_for_step(out: Path, step: int, procs, deadline_s: float = 240) -> None:
    """Until rank 0 wrote ``out/step`` >= ``step`` (the job is mid-run)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if int((out / "step").read_text() or 0) >= step:
                return
        except (OSError, ValueError):
            pass
        if any(p.poll() is not None for _, p in procs):
            raise AssertionError(
                "a node exited before the fault: "
                + "".join((p.communicate()[0] or "") for _, p in procs if p.poll() is not None)
            )
        time.sleep(0.1)
    raise AssertionError(f"the job never reached step {step}")


def final_state(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final.safetensors"))


def same_state(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
