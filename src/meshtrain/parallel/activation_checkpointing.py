"""Activation (gradient) checkpointing: recompute a block's activations in backward.

Trades one extra forward of each wrapped block for not storing its intermediate
activations: activation memory per block drops from everything inside it to its input.
Uses torch's non-reentrant checkpoint, which supports keyword arguments, parameters that
do not require grad, and nested autograd hooks (the gradient reducer's, ZeRO-3's).
Which modules are blocks is ``meshtrain.parallel.blocks``' answer.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtrain.parallel.blocks import blocks

FIELD = "activation_checkpointing.module_classes"


def apply_activation_checkpointing(model: nn.Module, class_names: list[str] | None = None) -> int:
    """Checkpoint the forward of each block in place; returns how many blocks."""
    found = blocks(model, list(class_names or []), FIELD)
    for block in found:
        if getattr(block, "_meshtrain_checkpointed", False):
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._meshtrain_checkpointed = True
    return len(found)
