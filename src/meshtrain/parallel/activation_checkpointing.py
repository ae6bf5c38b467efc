"""Activation (gradient) checkpointing: recompute a block's activations in backward.

Trades one extra forward of each wrapped block for not storing its intermediate
activations: activation memory per block drops from everything inside it to its input.
Uses torch's non-reentrant checkpoint, which supports keyword arguments, parameters that
do not require grad, and nested autograd hooks (the gradient reducer's, ZeRO-3's).
Which modules are blocks is ``meshtrain.parallel.blocks``' answer.

A transformers block appends its keys and values to the key/value cache it is handed, in
place: recomputed in backward it would append them a second time, and its attention
would then see twice the keys its mask covers (GPT-2 with padding fails in backward with
"size of tensor a (12) must match ... (6)"). So while gradients are recorded the wrapped
block gets no cache (``use_cache`` False, and the cache argument None), as transformers'
own checkpointed layers do; under ``no_grad`` (evaluation, ``generate``) it gets its
arguments unchanged and the cache works.

The cache argument is found by what it holds (``meshtrain.components.kv_cache``), since
transformers has renamed it over its releases, and by its known names for legacy tuples.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtrain.components.kv_cache import CACHE_NAMES, is_kv_cache
from meshtrain.parallel.blocks import blocks

FIELD = "activation_checkpointing.module_classes"


def _without_cache(sig: inspect.Signature | None, args: tuple, kwargs: dict):
    """``args, kwargs`` with any key/value cache dropped (passed by name or position)."""
    if sig is None:
        return args, kwargs
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:  # not a call this signature takes: let the block raise its own error
        return args, kwargs
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    for place in (bound.arguments, bound.arguments.get(var_kw, {})):  # named, then **kwargs
        for k, v in place.items():
            if k in CACHE_NAMES or is_kv_cache(v):
                place[k] = None
        if "use_cache" in place:
            place["use_cache"] = False
    return bound.args, bound.kwargs


def apply_activation_checkpointing(model: nn.Module, class_names: list[str] | None = None) -> int:
    """Checkpoint the forward of each block in place; returns how many blocks."""
    found = blocks(model, list(class_names or []), FIELD)
    for block in found:
        if getattr(block, "_meshtrain_checkpointed", False):
            continue
        inner = block.forward
        try:
            sig = inspect.signature(inner)
        except (TypeError, ValueError):  # a builtin or C forward: no cache to drop
            sig = None
        # only a forward that can be handed a cache pays for binding its arguments
        if sig is not None and not any(
            p.kind is p.VAR_KEYWORD or p.name in (*CACHE_NAMES, "use_cache")
            for p in sig.parameters.values()
        ):
            sig = None

        @functools.wraps(inner)
        def forward(*args, _inner=inner, _sig=sig, **kwargs):
            if torch.is_grad_enabled():  # recorded, so recomputed in backward
                args, kwargs = _without_cache(_sig, args, kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._meshtrain_checkpointed = True
    return len(found)
