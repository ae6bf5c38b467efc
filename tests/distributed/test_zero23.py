"""ZeRO stages 2 and 3 against one process and against meshtrain data parallelism.

Same protocol and tolerances as test_engine_dp / test_zero1: fp32, 20 AdamW steps at lr
1e-3, losses (relative) and whole-model parameters (normwise) within
``trajectory(1e-3, 20)`` (``tests/tolerance.py``); plain, with
gradient accumulation 2 + clipping 0.05, and with a frozen parameter; on the reference
decoder and on a non-transformer MLP (whose units are the Linear layers of its
nn.Sequential). Stage 3 runs with persistence threshold 0 (every parameter sharded) and
a prefetch budget smaller than the model, so prefetching is exercised.
"""

from __future__ import annotations

import pytest

from tests.distributed.training import engine_run, reference_run
from tests.harness import run_ranks
from tests.tolerance import check_trajectory, trajectory

STEPS = 20
FROZEN = {"decoder": ("layers.0.attn.q_proj.weight",), "plain": ("body.2.weight",)}
STAGE3 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 5000}


def zero(stage: int, **extra) -> dict:
    return {"zero_optimization": {"stage": stage, **(STAGE3 if stage == 3 else {}), **extra}}


def _runs(kind):
    import torch.distributed as dist

    out = {"dp": engine_run(kind, STEPS, micro=2, accum=1)}
    for stage in (2, 3):
        z = zero(stage)
        out[stage, "plain"] = engine_run(kind, STEPS, micro=2, accum=1, config_extra=z)
        out[stage, "accum_clip"] = engine_run(
            kind, STEPS, micro=2, accum=2, config_extra={**z, "gradient_clipping": 0.05}
        )
        out[stage, "frozen"] = engine_run(
            kind, STEPS, micro=2, accum=1, frozen=FROZEN[kind], config_extra=z
        )
    keep = dist.get_rank() == 0
    return {k: (v[0], v[1] if keep else None) for k, v in out.items()}


def _close(got, ref, name):
    check_trajectory(name, got, ref, trajectory(1e-3, STEPS))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["decoder", "plain"])
def test_stages_2_3_match_single_process_and_dp(kind, world):
    got = run_ranks(_runs, world, kind)[0]
    refs = {
        "plain": reference_run(kind, STEPS, batch=2 * world),
        "accum_clip": reference_run(kind, STEPS, batch=4 * world, clip=0.05, chunks=2),
        "frozen": reference_run(kind, STEPS, batch=2 * world, frozen=FROZEN[kind]),
    }
    for stage in (2, 3):
        for case, ref in refs.items():
            _close(got[stage, case], ref, f"stage {stage} {case}")
        _close(got[stage, "plain"], got["dp"], f"stage {stage} vs data parallel")
    # the frozen parameter never moved and got no optimizer state
    _, init_state = reference_run(kind, 0, batch=2)
    name = FROZEN[kind][0]
    for stage in (2, 3):
        assert (got[stage, "frozen"][1][name] == init_state[name]).all()
