"""Tensor-parallel mappings, layers and the vocab-parallel loss at tp 2 and tp 4 (gloo).

Every result is compared with the same computation in one process (each rank computes
the reference itself from the same seeded tensors). Tolerances (``tests/tolerance.py``):
the mappings only move and sum data (sums over T ranks in another order), and the layers'
outputs and the loss are fp32 matmuls/sums whose terms are added in a different order:
``evaluation()`` relative; gradients (of the inputs, weights and biases): ``gradient()``. Bytes and call counts are exact (``comm``'s convention).
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.tolerance import check, evaluation, gradient

OUT, GRAD = evaluation(), gradient()


def rel(a, b) -> float:

    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _ops(world: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.tensor import mappings as M
    from meshtrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    from meshtrain.parallel.tensor.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    topo = Topology(tp=world)
    g, r, s = topo.tp_group, topo.tp_group.rank, topo.stats
    out: dict = {}
    gen = torch.Generator().manual_seed(5)
    B, S, H = 2, 4 * world, 6
    full = torch.randn(B, S, H, generator=gen)
    per_rank = torch.randn(world, B, S, H, generator=gen)  # rank-specific inputs
    mine = per_rank[r].clone().requires_grad_(True)
    upstream = torch.randn(world, B, S, H, generator=gen)

    def run(fn, x, grad):
        before = (s.snapshot(),)
        y = fn(x)
        mid = s.snapshot()
        y.backward(grad)
        after = s.snapshot()
        return y, s.diff(mid, before[0]), s.diff(after, mid)

    nbytes = B * S * H * 4
    # copy_to_region: identity fwd, all-reduce bwd
    x = full.clone().requires_grad_(True)
    y, fb, bb = run(lambda t: M.copy_to_region(t, g), x, upstream[r])
    out["copy"] = (
        rel(y, full),
        rel(x.grad, upstream.sum(0)),
        fb,
        bb == {("all_reduce", "tp"): 2 * nbytes},
    )
    # reduce_from_region: all-reduce fwd, identity bwd
    y, fb, bb = run(lambda t: M.reduce_from_region(t, g), mine, upstream[0])
    out["reduce"] = (
        rel(y, per_rank.sum(0)),
        rel(mine.grad, upstream[0]),
        fb == {("all_reduce", "tp"): 2 * nbytes},
        bb,
    )
    # scatter / gather along hidden (H * world wide tensors)
    wide = torch.randn(B, S, H * world, generator=gen)
    x = wide.clone().requires_grad_(True)
    gy = torch.randn(B, S, H, generator=gen)
    y, fb, bb = run(lambda t: M.scatter_to_region(t, g), x, gy)
    out["scatter"] = (
        rel(y, wide.chunk(world, -1)[r]),
        fb,
        bb == {("all_gather", "tp"): nbytes * world},
    )
    mine2 = per_rank[r].clone().requires_grad_(True)
    y, fb, bb = run(lambda t: M.gather_from_region(t, g), mine2, wide)
    out["gather"] = (
        rel(y, torch.cat(list(per_rank), -1)),
        rel(mine2.grad, wide.chunk(world, -1)[r]),
        fb == {("all_gather", "tp"): nbytes * world},
        bb,
    )
    # sequence pair: gather along seq fwd / reduce-scatter bwd, and the reverse
    shard = per_rank[r][:, : S // world].clone().requires_grad_(True)
    y, fb, bb = run(lambda t: M.gather_from_sequence(t, g), shard, upstream[r])
    ref = torch.cat([per_rank[q][:, : S // world] for q in range(world)], 1)
    out["seq_gather"] = (
        rel(y, ref),
        rel(shard.grad, upstream.sum(0).chunk(world, 1)[r]),
        fb == {("all_gather", "tp"): nbytes},
        bb == {("reduce_scatter", "tp"): nbytes},
    )
    mine3 = per_rank[r].clone().requires_grad_(True)
    gshard = upstream[r][:, : S // world]
    y, fb, bb = run(lambda t: M.reduce_scatter_to_sequence(t, g), mine3, gshard)
    gfull = torch.cat([upstream[q][:, : S // world] for q in range(world)], 1)
    out["seq_rs"] = (
        rel(y, per_rank.sum(0).chunk(world, 1)[r]),
        rel(mine3.grad, gfull),
        fb == {("reduce_scatter", "tp"): nbytes},
        bb == {("all_gather", "tp"): nbytes},
    )
    try:
        M.gather_from_sequence(torch.ones(1, 3, 2), g)
        M.reduce_scatter_to_sequence(torch.ones(1, 2 * world + 1, 2), g)
        out["seq_error"] = None
    except Exception as exc:  # noqa: BLE001
        out["seq_error"] = (type(exc).__name__, str(exc))

    # ---------------------------------------------------------------- layers
    torch.manual_seed(3)
    fan_in, fan_out = 10, 4 * world + 2  # not a multiple of T: padded features
    for sp in (False, True):
        lin1 = nn.Linear(fan_in, fan_out)
        lin2 = nn.Linear(fan_out, fan_in)
        xin = torch.randn(B, S, fan_in, generator=gen)
        gout = torch.randn(B, S, fan_in, generator=gen)
        xr = xin.clone().requires_grad_(True)
        yr = lin2(F.gelu(lin1(xr)))
        yr.backward(gout)
        col = ColumnParallelLinear.from_module(lin1, g, sequence_parallel=sp)
        row = RowParallelLinear.from_module(lin2, g, sequence_parallel=sp)
        if sp:
            xt = xin.chunk(world, 1)[r].clone().requires_grad_(True)
            gt = gout.chunk(world, 1)[r]
            yref, xgref = yr.chunk(world, 1)[r], xr.grad.chunk(world, 1)[r]
        else:
            xt, gt, yref, xgref = xin.clone().requires_grad_(True), gout, yr, xr.grad
        yt = row(F.gelu(col(xt)))
        yt.backward(gt)
        from meshtrain.parallel.tensor.sharding import unshard_tensor

        wg1 = unshard_tensor(col.weight.grad, col.tp_specs["weight"], g)
        bg1 = unshard_tensor(col.bias.grad, col.tp_specs["bias"], g)
        wg2 = unshard_tensor(row.weight.grad, row.tp_specs["weight"], g)
        out["layers", sp] = {
            "y": rel(yt, yref),
            "dx": rel(xt.grad, xgref),
            "w1": rel(wg1, lin1.weight.grad),
            "b1": rel(bg1, lin1.bias.grad),
            "w2": rel(wg2, lin2.weight.grad),
            "b2": rel(row.bias.grad, lin2.bias.grad),
            "local": (tuple(col.weight.shape), tuple(row.weight.shape)),
        }
        lin1.zero_grad()
        lin2.zero_grad()

    # Conv1D (GPT-2's [in, out] weight), fused q|k|v split per block
    from transformers.pytorch_utils import Conv1D

    heads, hd = 2 * world + 1, 2  # padded heads at every T > 1
    conv = Conv1D(3 * heads * hd, H)
    torch.nn.init.normal_(conv.bias)
    xin = torch.randn(B, S, H, generator=gen, requires_grad=False)
    ref = conv(xin)  # [B, S, 3 * heads * hd]
    c = ColumnParallelLinear.from_module(conv, g, units=heads, blocks=3)
    yt = c(xin)
    u = -(-heads // world)
    blocks_ref = []
    for blk in ref.split(heads * hd, -1):
        padded = torch.cat((blk, blk.new_zeros(B, S, (u * world - heads) * hd)), -1)
        blocks_ref.append(padded[..., r * u * hd : (r + 1) * u * hd])
    out["conv_qkv"] = (rel(yt, torch.cat(blocks_ref, -1)), tuple(c.weight.shape))

    # vocab-parallel embedding (vocab not a multiple of T, padding_idx on some rank)
    vocab = 8 * world + 3
    emb = nn.Embedding(vocab, H, padding_idx=vocab - 2)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    ids[0, 0] = vocab - 2
    gy = torch.randn(B, S, H, generator=gen)
    yr = emb(ids)
    yr.backward(gy)
    for sp in (False, True):
        ve = VocabParallelEmbedding.from_module(emb, g, sequence_parallel=sp)
        yt = ve(ids)
        yt.backward(gy.chunk(world, 1)[r] if sp else gy)
        wg = unshard_tensor(ve.weight.grad, ve.tp_specs["weight"], g)
        out["embedding", sp] = (
            rel(yt, yr.chunk(world, 1)[r] if sp else yr),
            rel(wg, emb.weight.grad),
            tuple(ve.weight.shape),
        )

    # ---------------------------------------------------------------- loss
    V = 10 * world + 3
    N = 12
    logits = torch.randn(N, V, generator=gen)
    target = torch.randint(0, V, (N,), generator=gen)
    target[::3] = -100
    gl = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(gl, target, ignore_index=-100)
    ref.backward()
    vl = -(-V // world)
    padded = torch.cat((logits, torch.zeros(N, vl * world - V)), 1)
    local = padded[:, r * vl : (r + 1) * vl].clone().requires_grad_(True)

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            for t in res if isinstance(res, (tuple, list)) else (res,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return res

    before = s.snapshot()
    calls0 = s.calls(op="all_reduce")
    with Shapes() as shapes:
        loss = vocab_parallel_cross_entropy(local, target, g, V)
        mid = s.snapshot()
        loss.backward()
    end = s.snapshot()
    calls1 = s.calls(op="all_reduce")
    grad_full = torch.cat([t for t in _gather_cols(local.grad, g)], 1)[:, :V]
    none = vocab_parallel_cross_entropy(local.detach(), target, g, V, reduction="none")
    ref_none = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    out["ce"] = {
        "loss": rel(loss, ref),
        "grad": rel(grad_full, gl.grad),
        "none": rel(none, ref_none),
        "fwd": s.diff(mid, before),
        "bwd": s.diff(end, mid),
        "calls": calls1 - calls0,
        "largest": shapes.largest,
        "N": N,
        "V": V,
        "vl": vl,
    }
    return out


def _gather_cols(t, g):
    import torch

    from meshtrain.distributed import comm

    buf = torch.empty(g.size * t.numel())
    comm.all_gather(buf, t.contiguous().view(-1), g, label="test")
    return list(buf.view(g.size, *t.shape).unbind(0))


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_layers_and_loss(world):
    results = run_ranks(_ops, world, world)
    H = 6
    for out in results:
        c = out["copy"]
        assert c[0] == 0 and c[2] == {} and c[3]
        check("copy's backward", c[1], OUT)
        red = out["reduce"]
        assert red[1] == 0 and red[2] and red[3] == {}
        check("reduce", red[0], OUT)
        sc = out["scatter"]
        assert sc[0] == 0 and sc[1] == {} and sc[2]
        ga = out["gather"]
        assert ga[0] == 0 and ga[1] == 0 and ga[2] and ga[3] == {}
        for key in ("seq_gather", "seq_rs"):
            v = out[key]
            assert v[2] and v[3], (key, v)
            check(f"{key} forward", v[0], OUT)
            check(f"{key} backward", v[1], OUT)
        name, msg = out["seq_error"]
        assert name == "TopologyError" and "multiple of tensor_parallel_size" in msg
        for sp in (False, True):
            lay = out["layers", sp]
            for k in ("y", "dx", "w1", "b1", "w2", "b2"):
                check(f"layers sp={sp} {k}", lay[k], OUT if k == "y" else GRAD)
            # fan_out 4T + 2 padded to 5T: each rank holds 5 of the 10 x (4T + 2) padded
            assert lay["local"] == ((5, 10), (10, 5))
        err, shape = out["conv_qkv"]
        u = -(-(2 * world + 1) // world)
        assert shape == (H, 3 * u * 2)
        check("conv q|k|v", err, OUT)
        for sp in (False, True):
            e = out["embedding", sp]
            assert e[2] == (-(-(8 * world + 3) // world), H)
            check(f"embedding sp={sp} output", e[0], OUT)
            check(f"embedding sp={sp} gradient", e[1], GRAD)
        ce = out["ce"]
        check("vocab-parallel loss", ce["loss"], OUT)
        check("vocab-parallel loss gradient", ce["grad"], GRAD)
        check("vocab-parallel loss, reduction none", ce["none"], OUT)
        n = ce["N"]
        # two all-reduces in forward: the max (N floats) and [picked; sumexp] (2N floats)
        assert ce["fwd"] == {("all_reduce", "tp"): 2 * 4 * n + 2 * 8 * n}
        assert ce["bwd"] == {} and ce["calls"] == 2
        # the largest tensor any op produced is a local [N, V/T] slice, never [N, V]
        assert ce["largest"] <= n * ce["vl"] < n * ce["V"]
