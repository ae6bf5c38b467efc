"""``engine.train_batch`` / ``eval_batch`` with mesh.pipeline_parallel_size = 2 against the
same calls on one process (pp 1), through ``meshtrain.initialize`` and a JSON-style config.

The reference decoder with its LM head tied to the embedding (stage 0 and the last stage
both hold it), 4 micro-batches per step (gradient_accumulation_steps) of varying sequence
length, SGD, gradient clipping at 0.05 (active every step: the norm is ~1), an evaluation
at another batch size between steps. Tolerances (``tests/tolerance.py``, ``check_run``):
losses within ``trajectory`` of SGD's per-element steps (``sgd_rate``), global gradient
norms within ``gradient_from`` it, every parameter within ``per_tensor`` of it after 10
steps (fp32; the tied gradient is summed in another order). Matching under active clipping proves the norm is global across
stages with the tied weight counted once.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import check_run, sgd_rate, trajectory

STEPS = 10


def _data(step: int, m: int = 4, rows: int = 2, part: slice = slice(None)):
    """Micro-batches of one step; ``part`` selects a data-parallel replica's rows."""
    g = torch.Generator().manual_seed(700 + step)
    out = []
    for i in range(m):
        ids = torch.randint(0, 64, (rows, 5 + (3 * i + step) % 8), generator=g)[part]
        out.append((ids, ids))
    return out


def _train(pp: int, schedule: str, virtual: int, dp: int = 1, zero: int = 0):
    import meshtrain
    from tests.tiny_models import tiny_decoder

    model = tiny_decoder()
    config = {
        "train_micro_batch_size_per_gpu": 2 // dp,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "gradient_clipping": 0.05,
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": pp},
        "zero_optimization": {"stage": zero},
        "pipeline": {"schedule": schedule, "virtual_stages": virtual},
    }
    torch.set_num_threads(1)
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    r = engine.topology.dp_rank
    part = slice(r * 2 // dp, (r + 1) * 2 // dp)
    losses, norms = [], []
    for step in range(STEPS):
        if step == 4:
            losses.append(engine.eval_batch(iter(_data(99, m=3, rows=5)), 3).item())
        losses.append(engine.train_batch(iter(_data(step, part=part))).item())
        norms.append(engine.get_global_grad_norm())
    if engine.pipeline is None:
        params = dict(engine.module.named_parameters())
    else:
        params = {n: p for s in engine.module.stages.values() for n, p in s.names.items()}
        with pytest.raises(meshtrain.errors.ConfigError, match="train_batch"):
            engine(_data(0)[0])
    return losses, norms, {n: p.detach().clone() for n, p in params.items()}


def _tol(ref_params) -> float:
    numel = sum(t.numel() for t in ref_params.values())
    return trajectory(sgd_rate(0.05, numel, momentum=0.9), STEPS)


def test_engine_train_batch_pipeline_matches_one_process():
    ref_losses, ref_norms, ref_params = run_ranks(_train, 1, 1, "1f1b", 1)[0]
    assert all(n > 0.05 for n in ref_norms)  # clipping acts on every step
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        per_rank = run_ranks(_train, 2, 2, schedule, v)
        names = set()
        for rank, (losses, norms, params) in enumerate(per_rank):
            run = (losses, norms, params)
            check_run(
                f"{schedule} rank {rank}",
                run,
                (ref_losses, ref_norms, ref_params),
                _tol(ref_params),
            )
            names |= set(params)
        assert names == set(ref_params)


def test_engine_pipeline_times_data_parallel_zero1():
    """pp 2 x dp 2 on 4 ranks with ZeRO 1 over dp inside each stage: each replica gets
    one row of every 2-row micro-batch; same tolerances as above (the dp average adds
    one more summation-order difference)."""
    ref_losses, ref_norms, ref_params = run_ranks(_train, 1, 1, "1f1b", 1)[0]
    per_rank = run_ranks(_train, 4, 2, "1f1b", 1, 2, 1)
    names = set()
    for rank, run in enumerate(per_rank):
        check_run(
            f"pp 2 x dp 2 rank {rank}", run, (ref_losses, ref_norms, ref_params), _tol(ref_params)
        )
        names |= set(run[2])
    assert names == set(ref_params)
