"""ZeRO stage 1 (optimizer states and fp32 masters sharded over dp) against one process.

Same tolerance and protocol as test_engine_dp: fp32, 20 AdamW steps at lr 1e-3, losses
(relative) and whole-model parameters (normwise) within ``trajectory(1e-3, 20)``
(``tests/tolerance.py``). The bf16 run against the fp32 reference within
``against_fp32("bfloat16")``.
"""

from __future__ import annotations

import pytest

from tests.distributed.training import engine_run, reference_run
from tests.harness import run_ranks
from tests.tolerance import against_fp32, check, check_trajectory, trajectory

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
        check_trajectory(name, got[name], (ref_losses, ref_state), trajectory(1e-3, 20))
    # frozen parameters stay exactly at their initial value; bf16 still trains
    losses, state = got["frozen_bf16"]
    _, init_state = reference_run("decoder", 0, batch=2)
    assert (state[FROZEN[0]].float() == init_state[FROZEN[0]].bfloat16().float()).all()
    frozen_ref, _ = reference_run("decoder", 5, batch=2 * world, frozen=FROZEN)
    for step, (a, b) in enumerate(zip(losses, frozen_ref, strict=True)):
        check(f"frozen bf16 loss at step {step}", abs(a - b) / abs(b), against_fp32("bfloat16"))
