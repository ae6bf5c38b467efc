"""ZeRO stage 1 (optimizer states and fp32 masters sharded over dp) against one process.

Same tolerance and protocol as test_engine_dp: losses 1e-6 relative, whole-model
parameters normwise 1e-6, fp32, 20 AdamW steps.
"""

from __future__ import annotations

import pytest

from tests.distributed.training import engine_run, max_rel_diff, reference_run
from tests.harness import run_ranks

FROZEN = ("layers.0.attn.q_proj.weight",)


def _stage1(kind):
    import torch.distributed as dist

    z1 = {"zero_optimization": {"stage": 1}}
    runs = {
        "plain": engine_run(kind, 20, micro=2, accum=1, config_extra=z1),
        "accum_clip": engine_run(
            kind, 20, micro=2, accum=2, config_extra={**z1, "gradient_clipping": 0.05}
        ),
        "frozen_bf16": engine_run(
            kind, 5, micro=2, accum=1, frozen=FROZEN, config_extra={**z1, "bf16": {"enabled": True}}
        ),
    }
    keep = dist.get_rank() == 0
    return {k: (v[0], v[1] if keep else None) for k, v in runs.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_stage1_matches_single_process(world):
    got = run_ranks(_stage1, world, "decoder")[0]
    for name, batch, clip in (("plain", 2 * world, 0.0), ("accum_clip", 4 * world, 0.05)):
        ref_losses, ref_state = reference_run("decoder", 20, batch=batch, clip=clip)
        losses, state = got[name]
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-6 * abs(b)
        assert max_rel_diff(state, ref_state) <= 1e-6
    # frozen parameters stay exactly at their initial value; bf16 still trains
    losses, state = got["frozen_bf16"]
    _, init_state = reference_run("decoder", 0, batch=2)
    assert (state[FROZEN[0]].float() == init_state[FROZEN[0]].bfloat16().float()).all()
    frozen_ref, _ = reference_run("decoder", 5, batch=2 * world, frozen=FROZEN)
    assert all(abs(a - b) < 2e-2 * abs(b) for a, b in zip(losses, frozen_ref, strict=True))
