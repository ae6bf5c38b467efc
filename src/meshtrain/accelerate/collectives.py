"""Cross-process helpers of the Accelerator: gather, reduce, pad, and the exact-rows gather.

All of them run over the data-parallel group with plain ``torch.distributed`` calls (not
``meshtrain.distributed.comm``), so metric traffic never shows up in the engine's
per-step byte accounting. Every rank must call them with the same structure of tensors.
Over gloo, CUDA tensors go through host copies (``comm.host_staged``: gloo's CUDA support
is partial), as meshtrain's own collectives do.

``gather_for_metrics`` (accelerate#575, #2007): a prepared loader deals whole batches in
accelerate's order (``batch_shard``), so gathering one batch from every rank gives the
global step's slots in order, and at the end of a pass only its first rows are real (the
rest repeat the pass's first rows so that every rank ran the same number of batches):
``PreparedDataLoader.rows_kept`` says how many, and the rest are dropped, as accelerate
drops its ``remainder``. Each row of the dataset is therefore returned exactly once, in
the loader's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.distributed.comm import host_staged


def map_tensors(fn, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):  # dicts and transformers' BatchEncoding
        return type(data)({k: map_tensors(fn, v) for k, v in data.items()})
    if isinstance(data, list | tuple):
        return type(data)(map_tensors(fn, v) for v in data)
    return data


def has_tensor(data: Any) -> bool:
    if isinstance(data, Mapping):
        return any(has_tensor(v) for v in data.values())
    if isinstance(data, list | tuple):
        return any(has_tensor(v) for v in data)
    return isinstance(data, torch.Tensor)


def gather(data: Any, group, world: int) -> Any:
    """Concatenate every rank's tensors along dim 0 (0-d tensors become one row each).
    Tensors must have the same shape on every rank (``pad_across_processes`` first)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        if t.dim() == 0:
            t = t.reshape(1)
        if world == 1:
            return t.clone()
        device = t.device
        if host_staged(group, t):
            t = t.cpu()
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t, group=group)
        return torch.cat(out, dim=0).to(device)

    return map_tensors(one, data)


def gather_object(obj: Any, group, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def reduce(data: Any, group, world: int, reduction: str = "sum") -> Any:
    """All-reduce every tensor: ``"sum"`` or ``"mean"`` over the ranks."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduce: reduction={reduction!r}; use 'sum' or 'mean'")

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        if world > 1:
            all_reduce_staged(t, group)
        return t / world if reduction == "mean" else t

    return map_tensors(one, data)


def pad_across_processes(
    data: Any, group, world: int, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor along ``dim`` to the largest size any rank has (for ``gather``)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or world == 1:
            return t
        wire = torch.device("cpu") if host_staged(group, t) else t.device
        size = torch.tensor([t.shape[dim]], dtype=torch.int64, device=wire)
        sizes = [torch.empty_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        if longest == t.shape[dim]:
            return t
        shape = list(t.shape)
        shape[dim] = longest
        out = t.new_full(shape, pad_index)
        keep = [slice(None)] * t.dim()
        keep[dim] = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
        out[tuple(keep)] = t
        return out

    return map_tensors(one, data)


def all_reduce_staged(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """``dist.all_reduce`` of ``t`` in place over ``group`` (a process group, None: the
    default), on a host copy where the group's gloo would get a CUDA tensor."""
    if not host_staged(group, t):
        dist.all_reduce(t, op=op, group=group)
        return
    host = t.cpu()
    dist.all_reduce(host, op=op, group=group)
    t.copy_(host)


def broadcast_in_place(t: torch.Tensor, src: int = 0, group=None) -> None:
    """``dist.broadcast`` of ``t`` in place, whatever its device: a host tensor goes
    through the current CUDA device where the group's backend is NCCL alone (it takes no
    CPU tensors), a CUDA one through the host where the backend is gloo."""
    backend = dist.get_backend(group)
    if t.device.type == "cpu" and backend == "nccl":
        wire = t.to(torch.device("cuda", torch.cuda.current_device()))
    elif host_staged(group, t):
        wire = t.cpu()
    else:
        dist.broadcast(t, src=src, group=group)
        return
    dist.broadcast(wire, src=src, group=group)
    t.copy_(wire)


__all__ = [
    "all_reduce_staged",
    "broadcast_in_place",
    "gather",
    "has_tensor",
    "gather_object",
    "pad_across_processes",
    "reduce",
]
