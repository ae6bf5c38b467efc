"""transformers' ``lr_scheduler_type`` schedules (the names ``TrainingArguments`` takes;
the DeepSpeed config's ``scheduler`` section is ``lr_schedules``), with transformers'
formulas (``optimization.py``), as ``torch.optim.lr_scheduler.LambdaLR`` factors of the
optimizer's learning rate.

``w`` = warmup steps, ``T`` = total optimizer steps, ``s`` = steps taken so far:

* warmup (all but "constant"): ``s / max(1, w)`` while ``s < w``;
* linear: ``max(0, (T - s) / max(1, T - w))``;
* cosine: ``max(0, 0.5 * (1 + cos(pi * (s - w) / max(1, T - w))))``;
* constant / constant_with_warmup: ``1``.

A LambdaLR built from a ``functools.partial`` keeps a JSON-able ``state_dict`` (the
lambdas themselves are not saved), so it travels in the engine's checkpoints.
"""

from __future__ import annotations

import functools
import math

import torch


def _factor(kind: str, warmup: int, total: int, step: int) -> float:
    if kind != "constant" and step < warmup:
        return float(step) / float(max(1, warmup))
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine


def scheduler_factory(kind: str, warmup: int, total: int):
    """A callable ``optimizer -> LambdaLR`` (what ``meshtrain.initialize`` accepts as
    ``lr_scheduler``: it is built on the engine's optimizer)."""

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(_factor, kind, warmup, total)
        )

    return build


__all__ = ["scheduler_factory"]
