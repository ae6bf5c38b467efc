"""All-to-all (Ulysses) context-parallel attention at cp 2 and cp 4 on real gloo processes.

Each rank builds the whole sequence's q, k, v (seeded, the same on every rank), computes
``causal_attention`` over it in one process as the reference, then runs
``ulysses_attention`` on its load-balanced chunks (``i`` and ``2C-1-i``) and compares its
output and the gradients of its q, k, v slices with the reference's rows.

Tolerance: fp32, relative (norm of the difference over the norm of the reference). Both
sides run the same SDPA kernel over the same whole sequence in natural order, so each
score row sums the same terms; what differs is only how many heads one call batches (and
the zero heads padded in), which can change the kernel's blocking and so the order of a
few fp32 additions (~1e-7 relative measured): the output within ``evaluation()``, the
q, k, v gradients within ``gradient()`` (``tests/tolerance.py``).

Bytes are asserted exactly against ``CommStats`` and the collective ledger, computed in
the test from the shapes (not from the module's own formula, which is checked against
them too): forward and backward two all-to-alls each (q, k, v fused into one, then the
output; backward the output's gradient, then dq, dk, dv fused), carrying exactly the bytes
of the four separate ones, plus one all-gather of the int64 document ids when they are
given.
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.tolerance import check, evaluation, gradient


def _shard(t, cp: int, rank: int, dim: int):
    """Rank ``rank``'s chunks ``rank`` and ``2C-1-rank`` of ``t`` along ``dim``."""
    import torch

    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)


def _case(topo, *, B, hq, hkv, L, hd, docs=False, scale=None, seed=0) -> dict:
    """One parity + bytes check; returns relative errors, bytes and ledger entries."""
    import torch

    from meshtrain.models.attention import causal_attention
    from meshtrain.parallel.context.all_to_all import ulysses_attention, ulysses_bytes

    g, s = topo.cp_group, topo.stats
    cp, r = g.size, g.rank
    gen = torch.Generator().manual_seed(seed)
    Q = torch.randn(B, hq, L, hd, generator=gen, requires_grad=True)
    K = torch.randn(B, hkv, L, hd, generator=gen, requires_grad=True)
    V = torch.randn(B, hkv, L, hd, generator=gen, requires_grad=True)
    G = torch.randn(B, hq, L, hd, generator=gen)  # upstream gradient
    ids = None
    if docs:  # random document boundaries, global ids per row
        starts = torch.rand(B, L, generator=gen) < 0.15
        starts[:, 0] = True
        ids = starts.cumsum(-1)
    ref = causal_attention(Q, K, V, document_ids=ids, scale=scale)
    (ref * G).sum().backward()

    q, k, v = (_shard(t.detach(), cp, r, 2).requires_grad_(True) for t in (Q, K, V))
    local_ids = None if ids is None else _shard(ids, cp, r, 1)
    led = s.ledger
    n0 = len(led.entries)
    before = s.snapshot()
    out = ulysses_attention(q, k, v, g, document_ids=local_ids, scale=scale)
    mid = s.snapshot()
    fwd_ops = [e[2] for e in list(led.entries)[n0:]]
    n1 = len(led.entries)
    (out * _shard(G, cp, r, 2)).sum().backward()
    after = s.snapshot()
    bwd_ops = [e[2] for e in list(led.entries)[n1:]]

    def rel(a, b):
        return float((a.detach() - b).norm() / b.norm())

    return {
        "out": rel(out, _shard(ref.detach(), cp, r, 2)),
        "dq": rel(q.grad, _shard(Q.grad, cp, r, 2)),
        "dk": rel(k.grad, _shard(K.grad, cp, r, 2)),
        "dv": rel(v.grad, _shard(V.grad, cp, r, 2)),
        "fwd": s.diff(mid, before),
        "bwd": s.diff(after, mid),
        "fwd_ops": fwd_ops,
        "bwd_ops": bwd_ops,
        "formula": ulysses_bytes(B, L, hq, hkv, hd, 4, cp, documents=docs),
    }


# (name, B, Hq, Hkv, hd, document ids, scale): MHA; GQA with Hkv % C == 0 at C=2 and
# Hkv < C at C=4; MQA (Hkv = 1); Hq not divisible by C (3 heads; 6 GQA heads at C=4);
# packed documents with an explicit scale.
CASES = [
    ("mha", 2, 4, 4, 8, False, None),
    ("gqa", 1, 8, 2, 8, False, None),
    ("mqa", 2, 4, 1, 4, False, None),
    ("uneven", 1, 3, 3, 8, False, None),
    ("uneven_gqa", 1, 6, 2, 4, False, None),
    ("documents", 2, 4, 2, 8, True, 0.3),
]


def _expected_a2a(cp, B, hq, hkv, L, hd) -> int:
    """Recorded all-to-all bytes of one direction, from the shapes moved: q and the
    output carry the (padded) query heads, k and v the (repeated) key/value heads."""
    import math

    if hq % cp:
        hq = hkv = -(-hq // cp) * cp  # k/v repeated to Hq, all padded to a multiple of C
    elif hkv % cp:
        hkv = math.lcm(hkv, cp)
    return 4 * B * (L // cp) * hd * (2 * hq + 2 * hkv)


def _parity(world: int) -> dict:
    import torch

    from meshtrain.distributed.topology import Topology
    from meshtrain.errors import TopologyError
    from meshtrain.parallel.context.all_to_all import ulysses_attention

    topo = Topology(cp=world)
    L = 8 * world  # 2C chunks of 4 tokens
    res = {
        name: _case(topo, B=B, hq=hq, hkv=hkv, L=L, hd=hd, docs=d, scale=sc, seed=i)
        for i, (name, B, hq, hkv, hd, d, sc) in enumerate(CASES)
    }

    # size-1 group: plain causal attention, nothing recorded (odd lengths are fine there)
    x = torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(9))
    before = topo.stats.total()
    same = ulysses_attention(x, x, x, topo.tp_group)
    from meshtrain.models.attention import causal_attention

    res["size1"] = (torch.equal(same, causal_attention(x, x, x)), topo.stats.total() - before)

    refusals = {}
    t = torch.zeros(1, 4, 6, 4)
    bad = {
        "odd": (torch.zeros(1, 4, 5, 4),) * 3,
        "kv_len": (t, torch.zeros(1, 4, 4, 4), torch.zeros(1, 4, 4, 4)),
        "gqa": (t, torch.zeros(1, 3, 6, 4), torch.zeros(1, 3, 6, 4)),
        "rank3": (torch.zeros(4, 6, 4),) * 3,
    }
    for name, (q, k, v) in bad.items():
        try:
            ulysses_attention(q, k, v, topo.cp_group)
            refusals[name] = "accepted"
        except TopologyError as exc:
            refusals[name] = str(exc)
    try:
        ulysses_attention(t, t, t, topo.cp_group, document_ids=torch.zeros(1, 5, dtype=torch.long))
        refusals["docs"] = "accepted"
    except TopologyError as exc:
        refusals["docs"] = str(exc)
    res["refusals"] = refusals

    # the backward packs the gradients into memory the forward saved: a second backward
    # through the same graph must fail loudly (torch's in-place check), never read it
    q = torch.randn(1, 4, 8, 4, requires_grad=True)
    o = ulysses_attention(q, q, q, topo.cp_group)
    o.sum().backward(retain_graph=True)
    try:
        o.sum().backward()
        res["second_backward"] = "accepted"
    except RuntimeError as exc:
        res["second_backward"] = str(exc)

    # comm.all_to_all itself: slice j of rank r lands in slice r of rank j; input bytes
    from meshtrain.distributed import comm

    g = topo.cp_group
    send = torch.arange(2 * world, dtype=torch.float64) + 100 * g.rank
    recv = torch.empty_like(send)
    before = topo.stats.snapshot()
    comm.all_to_all(recv, send, g)
    res["a2a"] = (recv.tolist(), topo.stats.diff(topo.stats.snapshot(), before))
    try:
        comm.all_to_all(torch.empty(3), torch.empty(3), g)
        res["a2a_bad"] = "accepted"
    except ValueError as exc:
        res["a2a_bad"] = str(exc)
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_parity_and_bytes(world):
    results = run_ranks(_parity, world, world)
    L = 8 * world
    for r, res in enumerate(results):
        for name, B, hq, hkv, hd, docs, _ in CASES:
            got = res[name]
            for key in ("out", "dq", "dk", "dv"):
                check(
                    f"rank {r} {name} {key}", got[key], evaluation() if key == "out" else gradient()
                )
            a2a = _expected_a2a(world, B, hq, hkv, L, hd)
            fwd = {("all_to_all", "cp"): a2a}
            if docs:
                fwd[("all_gather", "cp")] = 8 * B * L  # int64 ids of the whole row
            assert got["fwd"] == fwd, (r, name)
            assert got["bwd"] == {("all_to_all", "cp"): a2a}, (r, name)
            # the ledger saw exactly two all-to-alls each way, q/k/v fused (and the ids' gather)
            assert got["fwd_ops"] == ["all_gather"] * docs + ["all_to_all"] * 2, (r, name)
            assert got["bwd_ops"] == ["all_to_all"] * 2, (r, name)
            f = got["formula"]
            assert f["forward_all_to_all"] == f["backward_all_to_all"] == a2a
            assert f["forward_all_gather"] == (8 * B * L if docs else 0)
        # multi-head: 4 (C-1)/C B (L/C) H hd w on the wire each way (DeepSpeed's 4Nh/P)
        assert res["mha"]["fwd"][("all_to_all", "cp")] * (world - 1) / world == pytest.approx(
            4 * (world - 1) / world * 2 * (L // world) * 4 * 8 * 4
        )
        assert res["size1"] == (True, 0)
        ref = res["refusals"]
        assert "odd number" in ref["odd"] and f"multiple of {2 * world}" in ref["odd"]
        assert "k (1, 4, 4, 4)" in ref["kv_len"]
        assert "not a multiple of 3 key/value heads" in ref["gqa"]
        assert "[B, H, L/C, hd]" in ref["rank3"]
        assert "document_ids (1, 5)" in ref["docs"]
        assert "modified by an inplace operation" in res["second_backward"]
        expected = [100.0 * j + 2 * r + i for j in range(world) for i in range(2)]
        assert res["a2a"] == (expected, {("all_to_all", "cp"): 2 * world * 8})
        assert "divisible by" in res["a2a_bad"]
