"""The traced split under tensor parallelism: a model with no block list, a config plan.

A chain of linears (``forward(x, labels)`` returning the loss, seed 003's shape) has no
``nn.ModuleList`` of blocks, so a pipeline cuts its traced forward
(``parallel.pipeline.traced``). Under tp its linears are already meshtrain's
column/row-parallel layers when the pipeline splits it; the tracer records each as one
call (their forwards run collectives), so each stage holds its layers' shards.

Real gloo ranks, pp 2 x tp 2 on 4 ranks against one process, 6 AdamW steps of 2
micro-batches at lr 1e-2: losses and the whole model (gathered, ``module_state_dict``)
within ``trajectory(1e-2, 6)`` (the tp matmuls reduce in another order). Its refusals
(sequence parallelism over a traced split) are in ``tests/layouts/refusals.py``.
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks
from tests.tiny_models import LINEAR_CHAIN_PLAN, LinearChain
from tests.tolerance import check_trajectory, trajectory

STEPS, MICRO, ROWS, LR = 6, 2, 4, 1e-2


def _batches(step: int) -> list[dict]:
    g = torch.Generator().manual_seed(100 + step)
    return [
        {
            "x": torch.randn(ROWS, 8, generator=g),
            "labels": torch.randint(0, 4, (ROWS,), generator=g),
        }
        for _ in range(MICRO)
    ]


def _config(pp: int, tp: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": pp, "tensor_parallel_size": tp},
        "tensor_parallel": {"plan": LINEAR_CHAIN_PLAN},
    }


def _train(pp: int, tp: int) -> tuple[list[float], dict]:
    import meshtrain

    engine, *_ = meshtrain.initialize(model=LinearChain(), config=_config(pp, tp))
    losses = []
    for step in range(STEPS):
        if pp > 1:
            losses.append(float(engine.train_batch(iter(_batches(step)))))
            continue
        total = 0.0
        for b in _batches(step):
            loss = engine(**b)
            engine.backward(loss)
            engine.step()
            total += float(loss) / MICRO
        losses.append(total)
    return losses, engine.module_state_dict()


def test_traced_split_under_tensor_parallelism_trains_like_one_process():
    per_rank = run_ranks(_train, 4, 2, 2, timeout=300)
    reference = run_ranks(_train, 1, 1, 1)[0]
    bound = trajectory(LR, STEPS)
    for rank, got in enumerate(per_rank):
        check_trajectory(f"pp 2 x tp 2 traced, rank {rank}", got, reference, bound)
