"""Engine checkpoints: bit-exact resume for ZeRO stages 0-3, and loading under another
data-parallel size and ZeRO stage with no conversion step.

Resume protocol: 6 fp32 AdamW steps straight through, against 3 steps -> save -> a fresh
engine (fresh model, fresh optimizer) loads -> 3 more steps. Losses and every parameter
must be *bit-identical*; the RNG streams continue where they were saved.

Reshard protocol: the global batch stays 8 rows whatever the world size (micro-batch
8 / world), so a run saved at size a and stage s and continued at size b and stage t
computes the same mathematics as the unchanged run, up to summation order: losses within
``trajectory(1e-3, 6)`` relative (``tests/tolerance.py``; the loaded run's 3 steps follow 3
whose reductions already ran in another order when the saved run differs in size).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.distributed.training import make_engine, train_steps
from tests.harness import run_ranks
from tests.tolerance import check, trajectory

STAGE3 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 5000}
GLOBAL = 8


def zero(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage, **(STAGE3 if stage == 3 else {})}}


def _draws():
    return (torch.rand(3).tolist(), random.random(), float(np.random.rand()))


def _bit_exact(root):
    import torch.distributed as dist

    out = {}
    for stage in (0, 1, 2, 3):
        straight = make_engine("decoder", 2, 1, {**zero(stage), "gradient_clipping": 0.5})
        losses, _, _ = train_steps(straight, "decoder", 6, 2, 1)
        want = straight.module_state_dict()

        first = make_engine("decoder", 2, 1, {**zero(stage), "gradient_clipping": 0.5})
        head, _, _ = train_steps(first, "decoder", 3, 2, 1)
        path = first.save_checkpoint(f"{root}/s{stage}", client_state={"note": stage})
        after_save = _draws()
        gathered = first.module_state_dict()  # every rank takes part in the gather
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            from meshtrain.checkpoint import consolidate

            exported = load_file(consolidate(f"{root}/s{stage}", f"{root}/s{stage}.safetensors"))
            out["export", stage] = exported.keys() == gathered.keys() and all(
                torch.equal(exported[k], gathered[k]) for k in gathered
            )
        _draws()  # move the streams on, so restoring them is visible

        second = make_engine("decoder", 2, 1, {**zero(stage), "gradient_clipping": 0.5})
        load_path, client = second.load_checkpoint(f"{root}/s{stage}")
        after_load = _draws()
        tail, _, _ = train_steps(second, "decoder", 3, 2, 1, first_step=3)
        got = second.module_state_dict()
        out[stage] = {
            "losses": head + tail == losses,
            "params": all(torch.equal(got[k], want[k]) for k in want),
            "rng": after_save == after_load,
            "client": client == {"note": stage},
            "path": str(load_path) == str(path) and path.name == "global_step3",
            "steps": second.global_steps == 6,
        }
    from meshtrain.errors import CheckpointError

    try:  # a checkpoint of another model: every difference is listed
        make_engine("plain", 2, 1, zero(1)).load_checkpoint(f"{root}/s1")
        out["wrong_model"] = None
    except CheckpointError as e:
        out["wrong_model"] = str(e)
    return out if dist.get_rank() == 0 else None


def test_bit_exact_resume_all_stages(tmp_path):
    out = run_ranks(_bit_exact, 2, str(tmp_path))[0]
    for stage in (0, 1, 2, 3):
        assert all(out[stage].values()), f"stage {stage}: {out[stage]}"
        # the consolidated file equals the gathered state dict, to the bit
        assert out["export", stage], f"stage {stage}: consolidated export differs"
    message = out["wrong_model"]
    assert message is not None
    for word in ("missing", "unexpected", "body.0.weight", "embed.weight"):
        assert word in message, message


def _save(root, cases):
    """Train 3 steps, save, then go on 3 more (the unchanged run's losses)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out = {}
    for name, stage in cases:
        engine = make_engine("decoder", GLOBAL // world, 1, zero(stage))
        train_steps(engine, "decoder", 3, GLOBAL // world, 1)
        engine.save_checkpoint(f"{root}/{name}")
        out[name], _, _ = train_steps(engine, "decoder", 3, GLOBAL // world, 1, first_step=3)
    return out


def _load(root, name, stage):
    import torch.distributed as dist

    world = dist.get_world_size()
    engine = make_engine("decoder", GLOBAL // world, 1, zero(stage))
    engine.load_checkpoint(f"{root}/{name}")
    losses, _, _ = train_steps(engine, "decoder", 3, GLOBAL // world, 1, first_step=3)
    return losses, engine.global_steps


@pytest.mark.slow
def test_load_under_other_world_size_and_stage(tmp_path):
    root = str(tmp_path)
    unchanged = run_ranks(_save, 2, root, [("a2s1", 1), ("a2s2", 2)])[0]
    unchanged.update(run_ranks(_save, 4, root, [("a4s3", 3)])[0])
    for name, world, stage in (("a2s1", 4, 3), ("a4s3", 2, 0), ("a2s2", 1, 2)):
        losses, steps = run_ranks(_load, world, root, name, stage)[0]
        assert steps == 6
        for step, (a, b) in enumerate(zip(losses, unchanged[name], strict=True)):
            what = f"{name} -> dp {world} stage {stage}, loss {step}"
            check(what, abs(a - b) / abs(b), trajectory(1e-3, 6))
