"""Ring attention's block math in one process (a cp group of one rank): the result and
the gradients equal ``causal_attention`` (SDPA) on the whole sequence, with grouped-query
heads and packed documents, with both per-block kernels (torch's CPU flash kernel and the
fp32 math of ``blocks.py``), also when a block is computed in several pieces of query rows
(``blocks.SCORE_ELEMENTS`` / ``ring.MASK_ELEMENTS`` made small). fp32; only the order of
additions differs (``tests/tolerance.py``): outputs and the log-sum-exp within
``evaluation()``, gradients within ``gradient()``, absolute on unit-scale values (observed
~1e-6; the flash kernel on one block is SDPA's own kernel, observed 0 without documents).

The flash kernel's contract the ring relies on is checked here too: it exists in this
torch, returns the log-sum-exp, takes grouped-query key/value heads as they are, and a
row whose keys are all masked comes back as ``o = 0`` (its ``lse``, 0, is replaced by
``-inf`` in the ring)."""

from __future__ import annotations

import pytest
import torch

from meshtrain.distributed.comm import Group
from meshtrain.distributed.comm_stats import CommStats
from meshtrain.models.attention import causal_attention
from meshtrain.parallel.context import blocks, ring
from meshtrain.parallel.context.ring import ring_attention
from tests.tolerance import evaluation, gradient

OUT, GRAD = evaluation(), gradient()


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_ring_block_math_matches_sdpa(monkeypatch, kernel, small, packed):
    if small:  # B x Hq x S x 5 scores (math) / B x S x 5 mask values (flash): 5 rows a piece
        monkeypatch.setattr(blocks, "SCORE_ELEMENTS", 2 * 4 * 16 * 5)
        monkeypatch.setattr(ring, "MASK_ELEMENTS", 2 * 16 * 5)
    if kernel == "math":
        monkeypatch.setattr(ring, "_backend", lambda q: ring._Math())
    one = Group("cp", None, (0,), 0, CommStats())
    gen = torch.Generator().manual_seed(0)
    q, go = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(2))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if packed else None
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*a, one, document_ids=docs)
    ref = causal_attention(*b, document_ids=docs)
    assert (out - ref).abs().max() < OUT
    for x, y in zip(torch.autograd.grad(out, a, go), torch.autograd.grad(ref, b, go), strict=True):
        assert (x - y).abs().max() < GRAD


def test_cpu_flash_kernel_contract():
    assert isinstance(ring._backend(torch.zeros(1, 1, 2, 4)), ring._FlashCPU)
    assert isinstance(ring._backend(torch.zeros(1, 1, 2, 4, dtype=torch.float64)), ring._Math)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=gen)
    k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(2))
    o, lse = ring._FlashCPU.fwd(q, k, v, 0.0, True)
    ref = causal_attention(q, k, v)
    assert (o - ref).abs().max() < OUT and lse.shape == (1, 4, 6)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 8**-0.5
    tri = torch.ones(6, 6, dtype=torch.bool).tril()
    want = torch.logsumexp(scores.masked_fill(~tri, float("-inf")), -1)
    assert (lse - want).abs().max() < OUT
    mask = torch.ones(1, 6, 6, dtype=torch.bool)
    mask[:, :2] = False  # rows 0 and 1 see nothing
    o, lse = ring._FlashCPU().forward(q, k, v, lambda lo, hi: mask[:, lo:hi], False, True, 0.3)
    assert torch.equal(o[:, :, :2], torch.zeros_like(o[:, :, :2]))
    assert torch.isinf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
