"""Two ranks as child processes of a GPU-check section, and what they leave behind.

The sections that need a process group (``multirank``, ``ring``) start a pair of
``python -m benchmarks.gpu.<module> <mode> <spec.json>`` children on one machine, each
appending its results to a shared JSON-lines file as they happen (``Records``), so a rank
that crashes or hangs loses nothing already measured; the parent reads the records back,
kills a pair that outlives its allowance and quotes the ranks' stderr without torch's
warning noise.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# torch's warnings in a rank's stderr: left out of the quoted tail
NOISE = re.compile(r"Warning:|return func\(|warnings\.warn\(|^(\[rank\d+\]:)?W\d{4} ")


class Records:
    """Appends one JSON line per event to a file both ranks share (one ``os.write`` of a
    short line under O_APPEND: lines do not interleave), so a crash loses nothing."""

    def __init__(self, path: str, rank: int, attempt: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank, self.attempt = rank, attempt

    def __call__(self, **rec) -> None:
        line = {"rank": self.rank, "attempt": self.attempt, "t": round(time.time(), 3), **rec}
        os.write(self.fd, (json.dumps(line, default=str) + "\n").encode())


def fault(variable: str, job: str, rank: int) -> None:
    """``<variable>=<job>:<rank>:crash|hang``: that rank dies or hangs in that job (checks
    the parent's recovery on CPU; never set in the GPU run)."""
    want = os.environ.get(variable, "")
    if want.rsplit(":", 2)[:2] != [job, str(rank)]:
        return
    if want.endswith(":crash"):
        os._exit(3)
    time.sleep(3600)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], work: Path, tag: str, dry: bool) -> list:
    """Two ranks of ``python -m <args>`` on one rendezvous; stderr to ``work/<tag>_rank<r>.err``.
    The dry run hides CUDA and makes the CPU tensors take the path CUDA tensors over gloo
    take (comm's host staging)."""
    port = free_port()
    path = os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # fmt: skip
        if dry:
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["MESHTRAIN_HOST_STAGING"] = "1"
        err = open(work / f"{tag}_rank{rank}.err", "w")  # noqa: SIM115 - closed by stop()
        cmd = [sys.executable, "-m", *args]
        procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=err, stderr=err), err))
    return procs


def read_records(path: Path, attempt: str | None = None) -> list[dict]:
    """The records in ``path`` (of one ``attempt``, or all); a line being written is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if attempt is None or rec.get("attempt") == attempt:
            out.append(rec)
    return out


def stop(procs: list) -> list:
    """Kill what still runs; the exit codes (None: would not die)."""
    rcs = []
    for p, err in procs:
        if p.poll() is None:
            p.kill()
        try:
            rcs.append(p.wait(timeout=10))
        except subprocess.TimeoutExpired:
            rcs.append(None)
        err.close()
    return rcs


def stderr_tail(work: Path, tag: str) -> str:
    """The last lines of each rank's stderr, torch's warnings left out."""
    parts = []
    for rank in range(2):
        f = work / f"{tag}_rank{rank}.err"
        text = f.read_text(errors="replace") if f.exists() else ""
        lines = [ln for ln in text.splitlines() if ln.strip() and not NOISE.search(ln)][-6:]
        if lines:
            parts.append(f"rank {rank}: " + " | ".join(lines))
    return "\n".join(parts)[-1500:]
