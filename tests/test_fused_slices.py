"""A fused optimizer steps each master chunk as one tensor; an unfused one in slices.

Slices of ``SLICE_NUMEL`` elements bound an element-wise optimizer's temporaries; torch's
fused kernels make none, and on an H200 the ~3.6k slices of the ~1B decoder cost the
engine 18 ms per step over a plain loop (docs/performance.md), so fused gets none.
"""

from __future__ import annotations

from meshtrain.parallel.zero.flat_group import SLICE_NUMEL
from tests.harness import run_ranks


def _leaves(fused: bool) -> dict:
    import meshtrain
    from meshtrain.models import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(seed=1))  # ~3.7M parameters: several slices per bucket
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "fused": fused}},
        "steps_per_print": 10**9,
    }
    engine, *_ = meshtrain.initialize(model=model, config=cfg)
    groups = engine.zero.flat_groups
    return {
        "leaves": len(engine.optimizer.param_groups[0]["params"]),
        "chunks": sum(len(g.master_chunks) for g in groups),
        "largest": max(m.numel() for m in engine.optimizer.param_groups[0]["params"]),
    }


def _both() -> dict:
    return {"fused": _leaves(True), "unfused": _leaves(False)}


def test_fused_optimizer_gets_one_leaf_per_chunk():
    out = run_ranks(_both, 1)[0]
    assert out["fused"]["leaves"] == out["fused"]["chunks"]
    assert out["fused"]["largest"] > SLICE_NUMEL
    assert out["unfused"]["leaves"] > out["unfused"]["chunks"]
    assert out["unfused"]["largest"] <= SLICE_NUMEL
