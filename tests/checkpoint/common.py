"""Hand-made sharded states for the checkpoint storage tests.

The engine decides which elements each rank owns; here two layouts stand in for it:
"param" is split in contiguous halves per rank (ZeRO-style partitions with odd sizes),
and "exp_avg" in round-robin blocks of 3 elements, so a rank holds several runs of one
tensor and reads cross many piece boundaries.
"""

from __future__ import annotations

import math

import torch

from meshtrain.checkpoint import Piece

SHAPES = {
    "embed.weight": (11, 6),
    "layer.w": (5, 3),
    "layer.b": (7,),
    "norm.scale": (1,),
    "temperature": (),
}
ALIASES = {"head.weight": "embed.weight"}
STATES = ("param", "exp_avg")


def full_state(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """``{state: {name: tensor}}``: the full, unsharded values the shards come from."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return {"param": params, "exp_avg": {n: t * 0.5 + 1 for n, t in params.items()}}


def meta(**extra) -> dict:
    tensors = {
        n: {"shape": list(s), "dtype": "float32", "kind": "param"} for n, s in SHAPES.items()
    }
    return {"tensors": tensors, "aliases": dict(ALIASES), "step": 7, **extra}


def _owned(state: str, numel: int, rank: int, world: int) -> list[tuple[int, int]]:
    """Runs ``(start, end)`` of a flattened tensor this rank owns."""
    if state == "param":
        per = math.ceil(numel / world)
        lo, hi = min(numel, rank * per), min(numel, (rank + 1) * per)
        return [(lo, hi)] if hi > lo else []
    return [(b, min(numel, b + 3)) for b in range(3 * rank, numel, 3 * world)]


def shard(
    full: dict[str, dict[str, torch.Tensor]], rank: int, world: int
) -> tuple[dict[str, torch.Tensor], list[Piece]]:
    """One flat buffer per state for this rank, and the pieces that point into it."""
    tensors, pieces = {}, []
    for state in STATES:
        parts, offset = [], 0
        for name, t in full[state].items():
            flat = t.reshape(-1)
            for lo, hi in _owned(state, flat.numel(), rank, world):
                parts.append(flat[lo:hi])
                pieces.append(Piece(name, state, f"{state}.flat", offset, lo, hi - lo))
                offset += hi - lo
        tensors[f"{state}.flat"] = torch.cat(parts) if parts else torch.empty(0)
    tensors["rng.torch"] = torch.get_rng_state()
    return tensors, pieces
