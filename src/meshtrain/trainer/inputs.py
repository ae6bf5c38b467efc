"""Moving a batch to the engine's device: the one rule the Trainer's training step, its
evaluation and the pipeline's schedule share (floats to the training dtype)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def move_to_device(inputs: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``inputs`` (tensors nested in dicts, lists, tuples) on ``device``; floating-point
    tensors cast to ``dtype`` when it is not float32 (fp16 / bf16 training)."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.to(device, non_blocking=True)
            return x.to(dtype) if x.is_floating_point() and dtype != torch.float32 else x
        if isinstance(x, Mapping):
            moved = {k: move(v) for k, v in x.items()}
            return type(x)(moved) if isinstance(x, dict) else moved
        if isinstance(x, list | tuple):
            return type(x)(move(v) for v in x)
        return x

    return move(inputs)


__all__ = ["move_to_device"]
