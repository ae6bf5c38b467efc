"""Checkpoints of expert-parallel training load at another ep, dp and ZeRO stage, and
consolidate to the one-process state dict (``checkpoint.expert_layout``).

Saved at ep 2 x edp 2 (world 4) under ZeRO-1 after 3 AdamW steps of ``ToyMoE``; loaded at
ep 2 x edp 1 (world 2) under ZeRO-3 and at ep 1 (world 1, every expert on one rank) under
ZeRO-0. Each load must give back the saved parameters exactly (fp32 masters are stored,
nothing is recomputed), and 2 further steps on the same global batches must match the
uninterrupted world-4 run within ``trajectory(1e-2, 2)`` normwise relative
(``tests/tolerance.py``: fp32 summation order of a
different rank count; the optimizer states came through the checkpoint, or the steps
would differ at ~1e-2). ``consolidate`` of the ep-2 checkpoint equals the whole model.
"""

from __future__ import annotations

import torch

from tests.distributed.expert_models import global_expert_state, toy_batch, toy_moe
from tests.distributed.test_zero_experts import initialize_ep
from tests.distributed.training import max_rel_diff
from tests.harness import run_ranks
from tests.tolerance import check, trajectory

GLOBAL_ROWS, LR = 16, 1e-2


def _config(stage: int, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": 0.3,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "loss": {"global_aux_loss": True},  # compared with one process on the whole batch
    }


def _steps(engine, first: int, count: int) -> None:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = GLOBAL_ROWS // world
    for step in range(first, first + count):
        x, y = toy_batch(step, GLOBAL_ROWS)
        engine.backward(
            engine(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
        )
        engine.step()


def _run(stage: int, ep: int, save_dir: str | None, load_dir: str | None) -> dict:
    import meshtrain
    from meshtrain.distributed.topology import Topology

    meshtrain.init_distributed()
    topo = Topology(ep=ep)
    import torch.distributed as dist

    engine = initialize_ep(toy_moe(topo), _config(stage, dist.get_world_size()), topo)
    out = {"ep_rank": topo.ep_rank}
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
        out["loaded"] = engine.module_state_dict()
        _steps(engine, 3, 2)
    else:
        _steps(engine, 0, 3)
        out["saved"] = engine.module_state_dict()
        engine.save_checkpoint(save_dir)
        _steps(engine, 3, 2)
    out["final"] = engine.module_state_dict()
    return out


def _whole(results: list[dict], key: str) -> dict:
    by_ep = {}
    for r in results:
        by_ep.setdefault(r["ep_rank"], r[key])
    return global_expert_state([by_ep[i] for i in sorted(by_ep)])


def test_expert_checkpoint_reshards_over_ep_dp_and_stage(tmp_path):
    from meshtrain.checkpoint import consolidate

    save_dir = str(tmp_path / "ckpt")
    first = run_ranks(_run, 4, 1, 2, save_dir, None)
    saved, final = _whole(first, "saved"), _whole(first, "final")
    # the consolidated file is the whole model: every expert at its global index
    from safetensors.torch import load_file

    out = consolidate(save_dir, tmp_path / "whole.safetensors")
    whole = load_file(str(out))
    assert whole.keys() == saved.keys()
    for k in saved:
        assert torch.equal(whole[k], saved[k]), k
    assert whole["blocks.0.w1"].shape[0] == 4  # all E experts, not one ep rank's 2
    for world, stage, ep in ((2, 3, 2), (1, 0, 1)):
        again = run_ranks(_run, world, stage, ep, None, save_dir)
        loaded = _whole(again, "loaded")
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), f"world {world} ep {ep}: {k}"
        err = max_rel_diff(_whole(again, "final"), final)
        check(f"world {world} ep {ep} stage {stage}: resumed run", err, trajectory(LR, 2))
    # sanity: the two extra steps move the model (the resume comparison is not vacuous)
    assert max_rel_diff(saved, final) > 1e-4
