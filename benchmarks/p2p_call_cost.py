"""CPU cost of one pipeline p2p call (``comm.batch_p2p``), hot and after a pause.

Two ranks (gloo, real processes): rank 0 posts sends and rank 1 receives of a small
activation (4 x 16 x 64 fp32), 40 calls each, one call after each of: nothing (a tight
loop), a 50 ms sleep (a pipeline stage waiting), a few matmuls (a stage computing). Prints
the median thread CPU (``thread_time``) and wall time of the call itself. The tight loop
shows gloo's own cost; the other two what a stage crossing pays in a real schedule
(``docs/pipeline.md``, "What is left per crossing").

    python benchmarks/p2p_call_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch

from meshtrain.launch.processes import run_on_ranks

CALLS = 40


def _pause(kind: str) -> None:
    if kind == "sleep 50 ms":
        time.sleep(0.05)
    elif kind == "after matmuls":
        x = torch.randn(256, 256)
        for _ in range(20):
            x = x @ x
            x = x / x.norm()


def _rank() -> dict:
    import torch.distributed as dist

    from meshtrain.distributed import comm
    from meshtrain.distributed.topology import Topology

    torch.set_num_threads(1)
    group = Topology(pp=2).pp_group
    t = torch.randn(4, 16, 64)
    out = {}
    for tag, kind in enumerate(("tight loop", "sleep 50 ms", "after matmuls")):
        dist.barrier()
        cpu, wall, works = [], [], []
        for _ in range(CALLS):
            _pause(kind)
            c0, w0 = time.thread_time(), time.perf_counter()
            if dist.get_rank() == 0:
                works += comm.batch_p2p(group, sends=[(t, 1)], label="probe", tag=tag)
            else:
                buf = torch.empty_like(t)
                works += comm.batch_p2p(group, recvs=[(buf, 0)], label="probe", tag=tag)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
        for w in works:
            w.wait()
        out[kind] = (1e3 * statistics.median(cpu), 1e3 * statistics.median(wall))
    return out


def main() -> int:
    send, recv = run_on_ranks(_rank, 2, (), timeout=300)
    for kind in send:
        print(
            f"{kind:14} send {send[kind][0]:.3f} ms CPU ({send[kind][1]:.3f} wall), "
            f"receive post {recv[kind][0]:.3f} ms CPU ({recv[kind][1]:.3f} wall)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
