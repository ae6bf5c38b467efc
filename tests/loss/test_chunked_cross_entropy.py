"""Chunked cross-entropy equals the plain LM head + ``F.cross_entropy``.

Tolerances (``tests/tolerance.py``): the loss within ``evaluation()`` relative and the
gradients within ``gradient()`` (fp32: the same sums in another order, per chunk instead
of one matmul). Covered: uneven last chunk, ignored targets, a chunk
larger than the tokens, gradients of hidden states and of the head weight, the
no-autograd path, and the vocab-parallel form on 2 ranks (each holding half the head's
rows, vocabulary padded) against the whole-vocabulary loss in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.loss import chunked_cross_entropy
from tests.harness import run_ranks
from tests.tolerance import evaluation, gradient

V, H, N = 101, 16, 37
OUT, GRAD = evaluation(), gradient()


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100
    return h, w, t


def _plain(h, w, t):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("chunk", [1, 8, 36, 1000])
def test_equals_the_plain_loss_and_gradients(chunk):
    h, w, t = _data()
    ref_loss, ref_h, ref_w = _plain(h, w, t)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_cross_entropy(hh, ww, t, chunk_size=chunk)
    (loss * 3.0).backward()  # the incoming gradient is applied
    assert abs(loss.item() - ref_loss.item()) <= OUT * abs(ref_loss.item())
    assert _rel(hh.grad, 3.0 * ref_h) <= GRAD
    assert _rel(ww.grad, 3.0 * ref_w) <= GRAD
    with torch.no_grad():  # evaluation: loss only
        assert abs(
            float(chunked_cross_entropy(h, w, t, chunk_size=chunk)) - float(ref_loss)
        ) <= OUT * float(ref_loss)


def test_bad_chunk_size_is_named():
    h, w, t = _data()
    with pytest.raises(ConfigError, match="loss.chunk_size"):
        chunked_cross_entropy(h, w, t, chunk_size=0)


def _vocab_parallel(chunk):
    from meshtrain.distributed.topology import Topology

    topo = Topology(tp=2)
    group, rank = topo.tp_group, topo.tp_group.rank
    h, w, t = _data()
    v_local = -(-V // 2)  # 51 rows each; rank 1's last row is padding
    padded = torch.cat([w, torch.zeros(2 * v_local - V, H)])
    mine = padded[rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    hh = h.clone().requires_grad_()
    loss = chunked_cross_entropy(
        hh, mine, t, chunk_size=chunk, group=group, vocab_start=rank * v_local, vocab_size=V
    )
    loss.backward()
    return float(loss), hh.grad, mine.grad


def test_vocab_parallel_on_two_ranks():
    h, w, t = _data()
    ref_loss, ref_h, ref_w = _plain(h, w, t)
    got = run_ranks(_vocab_parallel, 2, 8)
    for loss, gh, _ in got:
        assert abs(loss - float(ref_loss)) <= OUT * abs(float(ref_loss))
        assert _rel(gh, ref_h) <= GRAD
    whole = torch.cat([got[0][2], got[1][2]])
    assert _rel(whole[:V], ref_w) <= GRAD
    assert float(whole[V:].abs().max()) == 0.0  # padding rows get no gradient
