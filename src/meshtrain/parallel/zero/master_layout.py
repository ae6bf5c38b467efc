"""How a FlatGroup's fp32 master chunks are cut into the tensors an optimizer steps.

``meshtrain.optim.catalog`` says which layout each optimizer needs; ``FlatGroup`` packs
parameters on the layout's alignment grid and cuts its master slices here. The functions
read a group's public layout (``layout``, ``slice_numel``, ``align``, ``shapes``,
``owned_range``, its master chunks and slices) and are passed the group.
"""

from __future__ import annotations

import torch
from torch import nn

# How master slices are cut, and the alignment (elements) of every parameter's offset:
#   "flat"   any cut every slice_numel elements: element-wise optimizers (Adam, SGD, Lion)
#   "blocks" per parameter, on a 256-element grid from its first element, so blockwise
#            8-bit states (bitsandbytes: absmax per 256 elements) see the blocks they
#            would see on the whole parameter, whatever the sharding
#   "whole"  one slice per parameter, in its shape (Adafactor factors rows and columns and
#            scales by the parameter's RMS); ``zero.packing.pack_whole`` keeps every
#            parameter inside one rank's chunk
LAYOUTS: dict[str, int] = {"flat": 1, "blocks": 256, "whole": 1}


def _leaf(view: torch.Tensor, whole_numel: int, bits: int | None = None) -> nn.Parameter:
    """An optimizer leaf sharing ``view``'s storage; ``whole_numel`` is the numel of the
    parameter it belongs to (8-bit optimizers choose 8-bit state by that size), ``bits``
    the parameter's own optimizer-state width when it has one (``meshtrain_optim_bits``:
    32 for the embeddings transformers' Trainer keeps out of 8-bit state)."""
    leaf = nn.Parameter(view, requires_grad=True)
    leaf.meshtrain_whole_numel = whole_numel
    if bits is not None:
        leaf.meshtrain_optim_bits = bits
    return leaf


def master_leaves(chunk: torch.Tensor, spans) -> list[nn.Parameter]:
    """The optimizer leaves of one master ``chunk``, one per span of :func:`master_spans`."""
    return [
        _leaf(
            chunk.narrow(0, lo, n) if shape is None else chunk.narrow(0, lo, n).view(shape), *rest
        )
        for lo, n, shape, *rest in spans
    ]


def master_spans(group, bucket) -> list[tuple[int, int, torch.Size | None, int, int | None]]:
    """``(offset in the chunk, numel, shape, whole parameter's numel, its state bits or
    None)`` of each master slice of ``bucket`` (see ``LAYOUTS``; a "flat" slice may span
    parameters, so it has no bits of its own)."""
    if group.layout == "flat":
        cuts = range(0, bucket.chunk, group.slice_numel)
        return [
            (lo, min(group.slice_numel, bucket.chunk - lo), None, bucket.chunk, None) for lo in cuts
        ]
    lo, hi = group.owned_range(bucket)
    step = max(group.align, group.slice_numel // group.align * group.align)
    spans = []
    for p, off in zip(bucket.params, bucket.offsets, strict=True):
        shape = group.shapes[p]
        bits = getattr(p, "meshtrain_optim_bits", None)
        start, n = off - bucket.start, shape.numel()
        a, b = max(start, lo), min(start + n, hi)
        if a >= b:
            continue
        if group.layout == "whole":
            if (a, b) != (start, start + n):  # pack_whole never splits one
                raise RuntimeError(f"whole layout: a parameter of shape {tuple(shape)} is split")
            spans.append((a - lo, n, shape, n, bits))
            continue
        # "blocks": cut on the align grid measured from the parameter's first element
        for cut in range(a, b, step):
            spans.append((cut - lo, min(step, b - cut), None, n, bits))
    return spans


def join_state(group, bucket, state: dict) -> dict:
    """The optimizer state of ``bucket``'s master chunk, from the per-slice ``state``
    (``optimizer.state``): element-wise tensors joined over the slices, the rest
    (``step``) as the first slice holds it. Empty before the first step."""
    slices = group.master_slices[bucket.index]
    if group.layout != "flat":  # not element-wise: checkpoint.slice_state keeps them
        raise ValueError(f"join_state: the {group.layout!r} layout's states are not element-wise")
    per = [state.get(m, {}) for m in slices]
    out = {}
    for key, value in per[0].items():
        elementwise = isinstance(value, torch.Tensor) and value.shape == slices[0].shape
        out[key] = torch.cat([p[key] for p in per]) if elementwise and len(per) > 1 else value
    return out


def cut_state(group, bucket, state: dict, values: dict) -> None:
    """Inverse of ``optimizer_state``: tensors of the chunk's size are cut into the
    slices (views, no copy); anything else (``step``) is copied to each slice, since
    the optimizer updates it in place once per slice."""
    chunk = group.master_chunks[bucket.index]
    for i, master in enumerate(group.master_slices[bucket.index]):
        lo = i * group.slice_numel
        state[master] = {
            k: (
                v.narrow(0, lo, master.numel())
                if isinstance(v, torch.Tensor) and v.shape == chunk.shape
                else v.clone()
                if isinstance(v, torch.Tensor)
                else v
            )
            for k, v in values.items()
        }
