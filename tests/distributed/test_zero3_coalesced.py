"""ZeRO-3: the small buckets of a unit share one all-gather (``stage3.COALESCE_BYTES``).

The tiny decoder with its norm weights frozen has two buckets per layer (the frozen norms,
the trainable matrices), both under 1 MiB: each gather of a layer is one all-gather
instead of two. Packing and unpacking copy bytes, so the run must be bit-identical
(tolerance 0: losses and every parameter) to the same run with coalescing off
(``COALESCE_BYTES = 0``), with the same recorded all-gather bytes per step (the ZeRO
volume convention counts each bucket's bytes either way) and fewer all-gather calls.
Two ranks, three AdamW steps, the frozen buckets freed in backward as usual.
"""

from __future__ import annotations

from tests.distributed.training import make_engine, train_steps
from tests.harness import run_ranks

FROZEN = tuple(f"layers.{i}.{n}_norm.weight" for i in range(2) for n in ("attn", "mlp"))


def _run(coalesce: int):
    import meshtrain.parallel.zero.stage3 as stage3

    default = stage3.COALESCE_BYTES
    stage3.COALESCE_BYTES = coalesce
    try:
        z = {"stage": 3, "stage3_param_persistence_threshold": 0}
        engine = make_engine("decoder", 2, 1, {"zero_optimization": z}, frozen=FROZEN)
        per_unit = [len(u.buckets) for u in engine.zero.gatherer.units]
        before = engine.topology.stats.calls(op="all_gather")
        losses, step_bytes, _ = train_steps(engine, "decoder", 3, 2, 1)
        calls = engine.topology.stats.calls(op="all_gather") - before
        state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    finally:
        stage3.COALESCE_BYTES = default
    return losses, state, step_bytes, calls, per_unit


def _both():
    return _run(1 << 20), _run(0)


def test_coalesced_gathers_are_bit_identical_with_fewer_calls():
    import torch

    for on, off in run_ranks(_both, 2):
        assert on[0] == off[0], (on[0], off[0])
        assert on[1].keys() == off[1].keys()
        assert all(torch.equal(on[1][k], off[1][k]) for k in off[1])
        assert on[2] == off[2], (on[2], off[2])  # the same all-gather bytes each step
        assert max(on[4]) >= 2, on[4]  # the layers have a frozen and a trainable bucket
        assert 0 < on[3] < off[3], (on[3], off[3])
