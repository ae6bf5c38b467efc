"""A 2-rank job that goes wrong on purpose, for the hang doctor's tests.

    meshtrain launch --nproc_per_node 2 tests/distributed/doctor_worker.py MODE [RUN_DIR]

MODE: ``hang`` (rank 1 sleeps in Python before all_reduce #14 on dp), ``desync`` (at #14
rank 1 calls all_gather where rank 0 calls all_reduce), ``raise`` (rank 1 raises
ValueError before #14), ``exit3`` / ``exit0`` (rank 1 calls sys.exit before #14),
``stop`` (rank 1 sends itself SIGSTOP before #14). The collective timeout is 6 s.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch

import meshtrain
from meshtrain.distributed import comm
from meshtrain.distributed.topology import Topology


def all_started() -> None:
    """Wait (up to 5 min) until every rank got here, on the agent's store.

    The 6 s timeout below also bounds joining the group; on a loaded machine one rank can
    finish importing torch more than 6 s after the other, and a join that times out
    leaves no collective in any ledger (no doctor report: the tests then fail for the
    machine's load, not for the doctor)."""
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(minutes=5),
    )
    key = f"doctor_worker/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if store.add(f"{key}/arrived", 1) == int(os.environ["WORLD_SIZE"]):
        store.set(f"{key}/go", "1")
    store.wait([f"{key}/go"])


MODE = sys.argv[1]
if len(sys.argv) > 2:
    os.environ["MESHTRAIN_RUN_DIR"] = sys.argv[2]
all_started()
env = meshtrain.init_distributed(timeout_minutes=0.1)
topo = Topology(dp=env.world_size)
grad = torch.ones(4096)


def step(i: int) -> None:
    if env.rank == 1 and i == 14:
        if MODE != "desync":
            # rank 0 has 2 s to enter #14 first, so on a loaded machine too the table shows
            # it waiting there rather than killed between #13 and #14
            time.sleep(2)
        if MODE == "hang":
            time.sleep(3600)  # stuck in Python, not in a collective
        elif MODE == "raise":
            raise ValueError(f"bad batch at step {i}")
        elif MODE == "exit3":
            sys.exit(3)
        elif MODE == "exit0":
            sys.exit(0)
        elif MODE == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif MODE == "desync":
            out = torch.empty(4096)
            comm.all_gather(out, torch.ones(2048), topo.dp_group)
            return
    comm.all_reduce(grad, topo.dp_group)


for i in range(1, 20):
    step(i)
print(f"rank {env.rank} finished\n", end="", flush=True)  # one write: ranks share stdout
