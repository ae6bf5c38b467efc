"""gloo over CUDA tensors goes through host memory (``comm``'s "gloo over CUDA tensors"):
the decision, and the staged path run for real on CPU tensors.

Forced staging (a ``Group`` with ``host_staging=True``) copies every tensor to a new host
tensor, runs gloo on the copies and copies the outputs back, exactly what a CUDA tensor
gets; on 2 real gloo ranks every op (sync and async) must give bit-identical results to
the direct path, record the same bytes, and hand gloo the copies, never the caller's
tensors. The same 2 ranks check the raw process-group helpers of the Accelerator
(``collectives.all_reduce_staged``, ``gather``, ``broadcast_in_place``) with their staging
decision.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from tests.harness import run_ranks


def test_the_decision_is_gloo_on_cuda():
    from meshtrain.distributed.comm import stages_on_host

    assert stages_on_host("gloo", "cuda")
    assert not stages_on_host("gloo", "cpu")
    assert not stages_on_host("nccl", "cuda")
    assert stages_on_host("cpu:gloo,cuda:gloo", "cuda")
    assert not stages_on_host("cpu:gloo,cuda:nccl", "cuda")
    assert not stages_on_host("cpu:gloo,cuda:nccl", "cpu")


def test_a_group_forces_or_forbids_staging_and_cpu_tensors_never_ask_the_backend():
    from meshtrain.distributed.comm import CommStats, Group, host_staged, wire_device

    # pg=None: asking torch for its backend would raise, so a CPU tensor must not ask
    auto = Group("dp", None, (0, 1), 0, CommStats())
    x = torch.ones(3)
    assert not host_staged(auto, x)
    assert host_staged(dataclasses.replace(auto, host_staging=True), x)
    assert not host_staged(dataclasses.replace(auto, host_staging=False), x)
    assert wire_device(auto, torch.device("cpu")) == torch.device("cpu")
    assert wire_device(dataclasses.replace(auto, host_staging=True), "cpu").type == "cpu"


def _ops(group, r: int, world: int) -> dict:
    """Every comm op on ``group``, sync and async; the results as lists."""
    from meshtrain.distributed import comm

    out = {}
    x = torch.arange(6, dtype=torch.float32) * 0.1 + r
    comm.all_reduce(x, group)
    y = torch.arange(5, dtype=torch.float64) / 3 + r
    comm.all_reduce(y, group, async_op=True).wait()
    out["all_reduce"] = (x.tolist(), y.tolist())

    inp = torch.arange(4 * world, dtype=torch.bfloat16) + r
    o = torch.empty(4, dtype=torch.bfloat16)
    comm.reduce_scatter(o, inp, group, async_op=True).wait()
    full = torch.empty(3 * world)
    comm.all_gather(full, torch.full((3,), r + 0.5), group)
    out["reduce_scatter/all_gather"] = (o.float().tolist(), full.tolist())

    # ZeRO's buckets: out aliasing full's chunk, and a separate out
    bucket = torch.arange(4 * world, dtype=torch.float32) / 7 + r
    mine = bucket.narrow(0, r * 4, 4)
    comm.reduce_scatter_bucket(mine, bucket, group).wait()
    apart = torch.empty(4)
    comm.reduce_scatter_bucket(apart, torch.arange(4.0 * world) * (r + 1), group, False)
    params = torch.zeros(2 * world)
    params.narrow(0, r * 2, 2).fill_(r + 1.25)
    comm.all_gather_bucket(params, params.narrow(0, r * 2, 2), group).wait()
    gathered = torch.empty(2 * world)
    comm.all_gather_bucket(gathered, torch.full((2,), -r - 0.5), group, async_op=False)
    out["buckets"] = (mine.tolist(), apart.tolist(), params.tolist(), gathered.tolist())

    a2a_in = torch.arange(2 * world, dtype=torch.float32) + 10 * r
    a2a_out = torch.empty(2 * world)
    comm.all_to_all(a2a_out, a2a_in, group)
    # uneven splits: rank r sends r + 1 rows to each rank
    rows = torch.arange((r + 1) * world * 2, dtype=torch.float32).view(-1, 2) + 100 * r
    got = torch.empty(sum(q + 1 for q in range(world)), 2)
    comm.all_to_all(
        got, rows, group, output_splits=[q + 1 for q in range(world)],
        input_splits=[r + 1] * world, async_op=True,
    ).wait()  # fmt: skip
    out["all_to_all"] = (a2a_out.tolist(), got.tolist())

    b = torch.full((7,), float(r), dtype=torch.int64)
    comm.broadcast(b, src=world - 1, group=group)
    c = torch.full((3,), r * 2.5)
    comm.broadcast(c, src=0, group=group, async_op=True).wait()
    out["broadcast"] = (b.tolist(), c.tolist())

    send_t = [torch.full((6,), float(r)), torch.arange(3.0) + r]
    recv_t = [torch.empty(6), torch.empty(3)]
    right, left = (r + 1) % world, (r - 1) % world
    works = comm.batch_p2p(
        group, sends=[(t, right) for t in send_t], recvs=[(t, left) for t in recv_t], tag=3
    )
    for w in works:
        w.wait()
    if r == 0:
        comm.send(torch.ones(9, dtype=torch.float16) * 3, 1, group)
        blocking = None
    else:
        t = torch.empty(9, dtype=torch.float16)
        comm.recv(t, 0, group)
        blocking = t.tolist()
    out["p2p"] = ([t.tolist() for t in recv_t], blocking)
    return out


def _staged_against_direct():
    import torch.distributed as dist

    from meshtrain.accelerate import collectives as col
    from meshtrain.distributed.comm import host_staged
    from meshtrain.distributed.topology import Topology

    topo = Topology(dp=2)
    r, world = dist.get_rank(), 2
    direct = topo.dp_group
    staged = dataclasses.replace(direct, host_staging=True)

    seen: list[int] = []  # data pointers of the tensors torch's collectives were handed
    real = dist.all_reduce, dist.broadcast, dist.P2POp

    def all_reduce(t, *a, **k):
        seen.append(t.data_ptr())
        return real[0](t, *a, **k)

    def broadcast(t, *a, **k):
        seen.append(t.data_ptr())
        return real[1](t, *a, **k)

    def p2p(op, t, *a, **k):
        seen.append(t.data_ptr())
        return real[2](op, t, *a, **k)

    out = {"direct": _ops(direct, r, world)}
    before = topo.stats.total()
    dist.all_reduce, dist.broadcast, dist.P2POp = all_reduce, broadcast, p2p
    try:
        x = torch.ones(4)
        from meshtrain.distributed import comm

        comm.all_reduce(x, staged)
        handed_copy = x.data_ptr() not in seen
        seen.clear()
        b = torch.ones(4)
        comm.broadcast(b, 0, staged)
        w = comm.batch_p2p(staged, sends=[(b, 1 - r)], recvs=[(x, 1 - r)])
        for work in w:
            work.wait()
        handed_copy = handed_copy and not ({b.data_ptr(), x.data_ptr()} & set(seen))
    finally:
        dist.all_reduce, dist.broadcast, dist.P2POp = real
    mid = topo.stats.total()
    out["staged"] = _ops(staged, r, world)
    out["bytes"] = (mid - before - (2 * 16 + 16 + 16 + 16), topo.stats.total() - mid)
    out["direct_bytes"] = before
    out["handed_copy"] = handed_copy

    # the Accelerator's helpers on a raw process group: CPU tensors are not staged
    pg = direct.pg
    assert not host_staged(pg, torch.ones(1))
    t = torch.full((3,), r + 1.0)
    col.all_reduce_staged(t, pg)
    seed = torch.tensor([r + 7])
    col.broadcast_in_place(seed, 0, None)
    out["raw"] = (
        t.tolist(), col.gather(torch.tensor([r, r]), pg, world).tolist(), seed.tolist()
    )  # fmt: skip
    return out


def test_staged_ops_are_bit_identical_to_direct_ones_and_count_the_same_bytes():
    results = run_ranks(_staged_against_direct, 2)
    for r, out in enumerate(results):
        assert out["staged"] == out["direct"], r
        staged_bytes, after_probe = out["bytes"]
        assert staged_bytes == 0, r  # the probe's own calls, as counted by hand
        assert after_probe == out["direct_bytes"], r
        assert out["handed_copy"], r
        assert out["raw"] == ([3.0, 3.0, 3.0], [0, 0, 1, 1], [7]), r
    # and the values are the collectives' (not merely equal on both paths)
    d0, d1 = results[0]["direct"], results[1]["direct"]
    assert d0["broadcast"][0] == d1["broadcast"][0] == [1] * 7
    assert d0["p2p"][1] is None and d1["p2p"][1] == [3.0] * 9
    assert d0["buckets"][2] == [1.25, 1.25, 2.25, 2.25]


def test_pretrained_exchange_uses_the_wire_device_of_its_group():
    """The weights export's raw p2p (outside comm, by design) puts its buffers on
    ``comm.wire_device``: the CPU for a gloo group, whatever the model's device."""
    from meshtrain.distributed.comm import CommStats, Group, wire_device

    g = Group("world", None, (0, 1), 0, CommStats(), host_staging=True)
    assert wire_device(g, torch.device("cpu")).type == "cpu"
    topo = SimpleNamespace(device=torch.device("cpu"), group=lambda name: g, rank=0)
    from meshtrain.engine.pretrained_shards import RoundExchange

    ex = RoundExchange(topo, [[]], SimpleNamespace(runs={}), {}, [])
    assert ex._device.type == "cpu"


def _layouts_staged_and_not():
    """Each layout trained twice on this group, on a Topology without and one with
    ``MESHTRAIN_HOST_STAGING=1`` (every op staged): losses and whole models."""
    import os

    from meshtrain.plan.layout import Layout
    from tests.layouts.matrix import MICRO, ROWS
    from tests.layouts.ranks import mesh, train

    layouts = [
        Layout(pp=2, micro_batch=ROWS, grad_accum=MICRO),
        Layout(dp=2, stage=3, micro_batch=ROWS // 2, grad_accum=MICRO),
        Layout(cp=2, micro_batch=ROWS, grad_accum=MICRO),
        Layout(tp=2, micro_batch=ROWS, grad_accum=MICRO),
    ]
    out = []
    for layout in layouts:
        runs = []
        for staged in (False, True):
            os.environ["MESHTRAIN_HOST_STAGING"] = "1" if staged else ""
            meshes: dict = {}
            assert mesh(layout, meshes).host_staging is (True if staged else None)
            runs.append(train("llama", layout, meshes, 3))
        os.environ.pop("MESHTRAIN_HOST_STAGING")
        (la, sa), (lb, sb) = runs
        out.append(
            (la == lb, sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa))
        )
    return out


def test_layouts_train_bit_identically_with_every_op_staged():
    """pp 2, ZeRO-3 dp 2, cp 2 and tp 2 through the Engine with every collective staged
    (the path of CUDA tensors over gloo) train exactly as without: staging only copies."""
    for r, out in enumerate(run_ranks(_layouts_staged_and_not, 2)):
        assert out == [(True, True)] * 4, r
