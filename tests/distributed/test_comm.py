"""Counted collectives: exact bytes for every op at 2 and 4 ranks, and correct results.

Convention (meshtrain.distributed.comm): all_reduce records 2 x tensor bytes,
reduce_scatter the input bytes, all_gather the output bytes, broadcast/send/recv the
tensor bytes; nothing on a group of size 1.
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks


def _exercise(world: int):
    import torch
    import torch.distributed as dist

    from meshtrain.distributed import comm
    from meshtrain.distributed.topology import Topology

    topo = Topology(dp=world)
    g = topo.dp_group
    r = dist.get_rank()
    out = {}
    s = topo.stats

    x = torch.full((5,), float(r), dtype=torch.float32)
    comm.all_reduce(x, g)
    out["all_reduce"] = (x.tolist(), s.total(op="all_reduce"))

    inp = torch.arange(4 * world, dtype=torch.bfloat16) + r
    o = torch.empty(4, dtype=torch.bfloat16)
    comm.reduce_scatter(o, inp, g, async_op=True).wait()
    out["reduce_scatter"] = (o.float().tolist(), s.total(op="reduce_scatter"))

    full = torch.empty(3 * world, dtype=torch.float64)
    comm.all_gather(full, torch.full((3,), float(r), dtype=torch.float64), g)
    out["all_gather"] = (full.tolist(), s.total(op="all_gather"))

    b = torch.full((7,), float(r), dtype=torch.int64)
    comm.broadcast(b, src=world - 1, group=g)
    out["broadcast"] = (b.tolist(), s.total(op="broadcast"))

    # ring of batched p2p: send to the right, receive from the left
    send_t = torch.full((6,), float(r))
    recv_t = torch.empty(6)
    works = comm.batch_p2p(g, sends=[(send_t, (r + 1) % world)], recvs=[(recv_t, (r - 1) % world)])
    for w in works:
        w.wait()
    out["p2p"] = (recv_t.tolist(), s.total(op="send"), s.total(op="recv"))

    if r == 0:
        comm.send(torch.ones(9, dtype=torch.float16), 1, g)
    elif r == 1:
        t = torch.empty(9, dtype=torch.float16)
        comm.recv(t, 0, g)
    out["blocking_p2p"] = (s.total(op="send"), s.total(op="recv"))

    comm.all_reduce(torch.ones(1), g, label="control")
    out["by_group"] = s.by_group()
    out["control"] = s.total(op="control")
    out["wire"] = s.wire_bytes()
    out["calls"] = s.calls()
    # a size-1 group records nothing
    before = s.total()
    comm.all_reduce(torch.ones(100), topo.tp_group)
    out["size1"] = s.total() - before
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_exact_bytes(world):
    results = run_ranks(_exercise, world, world)
    total_rank_sum = float(sum(range(world)))
    for r, out in enumerate(results):
        assert out["all_reduce"] == ([total_rank_sum] * 5, 2 * 5 * 4)
        expected_rs = [world * (4 * r + i) + total_rank_sum for i in range(4)]
        assert out["reduce_scatter"] == (expected_rs, 4 * world * 2)
        assert out["all_gather"] == (
            [float(q) for q in range(world) for _ in range(3)],
            3 * world * 8,
        )
        assert out["broadcast"] == ([world - 1] * 7, 7 * 8)
        assert out["p2p"] == ([float((r - 1) % world)] * 6, 6 * 4, 6 * 4)
        sent = 6 * 4 + (9 * 2 if r == 0 else 0)
        received = 6 * 4 + (9 * 2 if r == 1 else 0)
        assert out["blocking_p2p"] == (sent, received)
        assert out["control"] == 2 * 4
        volume = 40 + 8 * world + 24 * world + 56 + sent + received + 8
        assert out["by_group"] == {"dp": volume}
        ring = (world - 1) / world
        expected_wire = (40 + 8 * world + 24 * world + 8) * ring + 56 + sent + received
        assert out["wire"] == pytest.approx(expected_wire)
        assert out["calls"] == 7 + (1 if r in (0, 1) else 0)
        assert out["size1"] == 0
