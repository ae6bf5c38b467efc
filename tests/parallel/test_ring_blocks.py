"""Ring attention's block math in one process (a cp group of one rank): the result and
the gradients equal ``causal_attention`` (SDPA) on the whole sequence, with grouped-query
heads and packed documents, also when a block's scores are computed in several pieces of
query rows (``blocks.SCORE_ELEMENTS`` made small). fp32; only the order of additions
differs: 1e-5 absolute on unit-scale values (observed ~1e-6)."""

from __future__ import annotations

import pytest
import torch

from meshtrain.distributed.comm import Group
from meshtrain.distributed.comm_stats import CommStats
from meshtrain.models.attention import causal_attention
from meshtrain.parallel.context import blocks
from meshtrain.parallel.context.ring import ring_attention


@pytest.mark.parametrize("budget", [blocks.SCORE_ELEMENTS, 2 * 4 * 16 * 5])
@pytest.mark.parametrize("packed", [False, True])
def test_ring_block_math_matches_sdpa(monkeypatch, budget, packed):
    monkeypatch.setattr(blocks, "SCORE_ELEMENTS", budget)  # B x Hq x S x 5: 5 query rows a piece
    one = Group("cp", None, (0,), 0, CommStats())
    gen = torch.Generator().manual_seed(0)
    q, go = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(2))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if packed else None
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*a, one, document_ids=docs)
    ref = causal_attention(*b, document_ids=docs)
    assert (out - ref).abs().max() < 1e-5
    for x, y in zip(torch.autograd.grad(out, a, go), torch.autograd.grad(ref, b, go), strict=True):
        assert (x - y).abs().max() < 1e-5
