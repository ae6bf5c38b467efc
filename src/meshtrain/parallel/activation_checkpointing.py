"""Activation (gradient) checkpointing: recompute a block's activations in backward.

Trades one extra forward of each wrapped block for not storing its intermediate
activations: activation memory per block drops from everything inside it to its input.
Uses torch's non-reentrant checkpoint, which supports keyword arguments, parameters that
do not require grad, and nested autograd hooks (the gradient reducer's).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def modules_of_classes(
    model: nn.Module, class_names: list[str], field: str, outermost: bool = False
) -> list[nn.Module]:
    """The modules of ``model`` whose class name is listed (only the outermost of nested
    matches with ``outermost``); ConfigError naming config ``field`` when a name matches
    nothing."""
    wanted = set(class_names)
    found, inside = [], set()
    for m in model.modules():
        if type(m).__name__ in wanted and id(m) not in inside:
            found.append(m)
            if outermost:
                inside.update(id(s) for s in m.modules())
    present = sorted({type(m).__name__ for m in model.modules()})
    missing = wanted - set(present)  # a class nested inside a match is not missing
    if missing:
        from meshtrain.errors import ConfigError

        raise ConfigError(
            f"{field}: {sorted(missing)} not found in the model; its module classes are {present}"
        )
    return found


def _blocks(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    if class_names:
        return modules_of_classes(model, class_names, "activation_checkpointing.module_classes")
    for m in model.modules():  # default: each block of the first ModuleList
        if isinstance(m, nn.ModuleList) and len(m):
            return list(m)
    return []


def apply_activation_checkpointing(model: nn.Module, class_names: list[str] | None = None) -> int:
    """Checkpoint the forward of each matching module in place; returns how many."""
    blocks = _blocks(model, list(class_names or []))
    for block in blocks:
        if getattr(block, "_meshtrain_checkpointed", False):
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._meshtrain_checkpointed = True
    return len(blocks)
