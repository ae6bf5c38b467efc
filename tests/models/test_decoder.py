"""The reference decoder: deterministic init, causality, loss, counting helpers."""

from __future__ import annotations

import math

import pytest
import torch

from meshtrain.models import Decoder, DecoderConfig, count_parameters, flops_per_token
from tests.tolerance import evaluation, relative

TINY = DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)


def test_init_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a, b = Decoder(TINY), Decoder(TINY)
    assert torch.equal(torch.get_rng_state(), state)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    other = Decoder(DecoderConfig(**{**TINY.to_dict(), "seed": 7}))
    assert not torch.equal(a.embed.weight, other.embed.weight)


def test_blocks_are_a_module_list():
    m = Decoder(TINY)
    assert isinstance(m.layers, torch.nn.ModuleList) and len(m.layers) == TINY.n_layers


def test_causal_and_loss():
    m = Decoder(TINY)
    x = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 64
    with torch.no_grad():
        lx, ly = m(x), m(y)
    assert lx.shape == (2, 10, 64)
    # the future cannot leak back (the same rows, one evaluation: tests/tolerance.py)
    assert relative(lx[:, :7], ly[:, :7]) <= evaluation()
    assert not torch.allclose(lx[:, 7:], ly[:, 7:])
    loss = m(x, labels=x)
    expected = torch.nn.functional.cross_entropy(lx[:, :-1].reshape(-1, 64), x[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(expected.item(), rel=evaluation())
    assert abs(loss.item() - math.log(64)) < 0.5  # near-uniform at init
    masked = x.clone()
    masked[:, 5:] = -100
    expected_masked = torch.nn.functional.cross_entropy(
        lx[:, :4].reshape(-1, 64), x[:, 1:5].reshape(-1)
    )
    assert m(x, labels=masked).item() == pytest.approx(expected_masked.item(), rel=evaluation())


def test_counting_helpers():
    m = Decoder(TINY)
    d, f, v, n = TINY.dim, TINY.ffn_dim, TINY.vocab_size, TINY.n_layers
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    assert count_parameters(m) == 2 * v * d + n * per_layer + d
    tied = Decoder(DecoderConfig(**{**TINY.to_dict(), "tie_embeddings": True}))
    assert count_parameters(tied) == v * d + n * per_layer + d
    assert flops_per_token(TINY, 16) == 6 * (n * (4 * d * d + 3 * d * f) + d * v) + 12 * n * d * 16
    assert flops_per_token(TINY, 16, training=False) == flops_per_token(TINY, 16) / 3


def test_bad_sizes():
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        DecoderConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        Decoder(TINY)(torch.zeros(1, 17, dtype=torch.long))
