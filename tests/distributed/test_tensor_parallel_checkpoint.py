"""Checkpoints reshard across tensor-parallel sizes with no conversion step (4 ranks).

Save the reference decoder (6 heads, MLP 98, vocabulary 250: padded at tp 4) at
tp 2 x dp 2 with ZeRO 1 after 3 AdamW steps; the same run continues 3 more steps. Load
that checkpoint at tp 1 x dp 4 with ZeRO 3 and at tp 4 x dp 1 with ZeRO 0 and continue
the same 3 steps on the same global batches: per-step losses and the final parameters
must match the unchanged run within ``trajectory(1e-3, 3)`` (relative / normwise,
``tests/tolerance.py``; fp32 sums in another order, as in the parity tests). ``meshtrain consolidate`` of the tp 2 checkpoint gives
the unpadded, unsharded tensors equal to ``engine.module_state_dict()`` exactly.

Grouped-query padding (3 ranks): tiny Llama (8 query, 4 key/value heads, padded to 12 and
6 at tp 3) saved at tp 3 after 3 steps loads at tp 1 x dp 3 with ZeRO 1 and continues
within the same bound; its consolidated file holds the unpadded tensors.
"""

from __future__ import annotations

from tests.harness import run_ranks
from tests.tolerance import check, trajectory

ADAMW = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
TOL = trajectory(ADAMW["lr"], 3)  # the 3 steps after loading
GLOBAL = 4


def _engine(tp: int, stage: int, kind: str = "decoder", global_bs: int = GLOBAL):
    import torch.distributed as dist

    import meshtrain
    from tests.distributed.tp_models import build

    dp = dist.get_world_size() // tp
    config = {
        "train_micro_batch_size_per_gpu": global_bs // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "mesh": {"tensor_parallel_size": tp},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    engine, *_ = meshtrain.initialize(model=build(kind), config=config)
    return engine


def _steps(
    engine, first: int, n: int, kind: str = "decoder", global_bs: int = GLOBAL
) -> list[float]:
    import torch.distributed as dist

    from tests.distributed.tp_models import batch

    dp, d = engine.topology.dp_size, engine.topology.dp_rank
    m = global_bs // dp
    out = []
    for step in range(first, first + n):
        full = batch(kind, step, global_bs)
        mine = [full[k][d * m : (d + 1) * m] for k in ("input_ids", "labels")]
        loss = engine(*mine) if kind == "decoder" else engine(*mine[:1], labels=mine[1]).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().double().reshape(1)
        dist.all_reduce(t)
        out.append(float(t) / dist.get_world_size())
    return out


def _reshard(
    tmp: str,
    kind: str = "decoder",
    tp_save: int = 2,
    loads=((1, 3), (4, 0)),
    global_bs: int = GLOBAL,
) -> dict:
    import torch
    import torch.distributed as dist

    from meshtrain.checkpoint.consolidate import consolidate

    a = _engine(tp_save, 1, kind, global_bs)
    _steps(a, 0, 3, kind, global_bs)
    path = a.save_checkpoint(tmp, tag="saved")
    saved_state = a.module_state_dict()
    cont = _steps(a, 3, 3, kind, global_bs)
    final = a.module_state_dict()
    out: dict = {}
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        target = consolidate(path, f"{tmp}/full.safetensors")
        full = load_file(str(target))
        out["consolidated"] = sorted(full) == sorted(saved_state) and all(
            torch.equal(full[k], saved_state[k]) for k in saved_state
        )
    dist.barrier()
    for tp, stage in loads:
        e = _engine(tp, stage, kind, global_bs)
        e.load_checkpoint(tmp, tag="saved")
        losses = _steps(e, 3, 3, kind, global_bs)
        state = e.module_state_dict()
        num = sum(float((state[k] - final[k]).pow(2).sum()) for k in final)
        den = sum(float(final[k].pow(2).sum()) for k in final)
        out[tp] = {
            "loss": max(abs(x - y) / abs(y) for x, y in zip(losses, cont, strict=True)),
            "params": (num / den) ** 0.5,
            "global_steps": e.global_steps,
        }
    return out


def test_checkpoint_reshards_across_tp_sizes(tmp_path):
    results = run_ranks(_reshard, 4, str(tmp_path), timeout=600)
    assert results[0]["consolidated"]
    for out in results:
        for tp in (1, 4):
            o = out[tp]
            check(f"tp {tp} losses", o["loss"], TOL)
            check(f"tp {tp} parameters", o["params"], TOL)
            assert o["global_steps"] == 6, (tp, o)


def test_padded_gqa_checkpoint_reshards(tmp_path):
    results = run_ranks(_reshard, 3, str(tmp_path), "llama", 3, ((1, 1),), 3, timeout=600)
    assert results[0]["consolidated"]
    for out in results:
        o = out[1]
        check("tp 1 losses", o["loss"], TOL)
        check("tp 1 parameters", o["params"], TOL)
        assert o["global_steps"] == 6, o
