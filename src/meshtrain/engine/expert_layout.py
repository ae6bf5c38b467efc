"""Where an ep rank's experts sit in the whole tensor: checkpoints name expert pieces by
their global expert index, so a checkpoint saved at one ep loads at any other.

An expert parameter (``meshtrain.parallel.experts.is_expert_param``) holds the experts of
this ep rank only, stacked along its expert dimension (``param.meshtrain_expert_dim``,
default 0): ep rank ``i`` of ``ep`` holds experts ``[i E / ep, (i + 1) E / ep)`` of ``E``.
That is a tensor-parallel-style shard of one dimension over the ep group, so it is
described by the same ``ShardSpec`` (``units = E`` over ``size = ep`` ranks) and mapped to
the whole tensor's flattened index space with the same ``full_runs``: a rank's pieces are
written, and read back, in the full ``(E, ...)`` tensor's index space, and the meta
records the full shape. At ep 1 nothing changes (the whole tensor is local).

An expert parameter that is also tensor-parallel-sharded is refused by name (experts are
not split over tp in meshtrain).
"""

from __future__ import annotations

import torch

from meshtrain.engine.engine_view import EngineView
from meshtrain.errors import CheckpointError
from meshtrain.parallel.experts import is_expert_param
from meshtrain.parallel.tensor.sharding import ShardSpec

EXPERT_DIM_ATTR = "meshtrain_expert_dim"


def expert_dim(p: torch.Tensor) -> int:
    """The dimension along which ``p`` stacks its experts (default 0)."""
    return int(getattr(p, EXPERT_DIM_ATTR, 0))


def expert_specs(engine: EngineView) -> tuple[dict[int, ShardSpec], int] | None:
    """``({id(param): ShardSpec over ep}, ep rank)`` of every expert parameter the engine
    holds, or None at ep 1. Shapes come from the flat groups (ZeRO-3 leaves placeholders)."""
    topo = engine.topology
    if topo.ep_size == 1:
        return None
    groups = [*engine.zero.flat_groups, *engine.zero.frozen_groups]
    shapes = {id(p): tuple(s) for g in groups for p, s in g.shapes.items()}
    tp_sharded = set()
    if topo.tp_size > 1:
        from meshtrain.parallel.tensor.sharding import specs_by_param

        tp_sharded = set(specs_by_param(engine.module))
    specs: dict[int, ShardSpec] = {}
    for name, p in engine.module.named_parameters():
        if not is_expert_param(p):
            continue
        if id(p) in tp_sharded:
            raise CheckpointError(
                f"checkpoint: {name} is both an expert parameter and tensor-parallel "
                "sharded, a layout meshtrain does not build; keep experts whole over tp"
            )
        shape = shapes.get(id(p), tuple(p.shape))
        d = expert_dim(p)
        specs[id(p)] = ShardSpec(dim=d, units=shape[d] * topo.ep_size, size=topo.ep_size)
    return specs, topo.ep_rank


def stage0_writers(engine: EngineView) -> dict[int, tuple[int, int]]:
    """(ranks, this rank's place) that share the writing of each flat group at ZeRO-0, where
    every replica holds it whole: its part's replica group (``dp x cp``; ``edp`` for the
    expert part), so each element is written once."""
    return {
        id(g): (p.replicas.size, p.replicas.rank) for p in engine.zero.parts for g in p.flat_groups
    }


def frozen_split(engine: EngineView, ep, t: torch.Tensor, key: str, share: int, part: int):
    """``(ranks, place, full offset)`` for writing a whole frozen tensor ``t``: as given
    (``share`` ranks, this one ``part``, offset 0), or for frozen experts split over the
    edp x tp ranks holding the same experts and offset to this ep rank's experts."""
    if ep is None or id(t) not in ep[0]:
        return share, part, 0
    spec = ep[0][id(t)]
    if spec.dim != 0:
        raise CheckpointError(
            f"checkpoint: frozen expert parameter {key} stacks its experts along dimension "
            f"{spec.dim}; frozen experts are saved along dimension 0 only (set "
            f"{EXPERT_DIM_ATTR} to 0, or train them)"
        )
    topo, edp = engine.topology, engine.topology.group("edp")
    place = edp.rank * topo.tp_size + topo.tp_rank
    return edp.size * topo.tp_size, place, ep[1] * t.numel()  # dim 0: one run per ep rank


def local_experts(full: torch.Tensor, spec: ShardSpec, ep_rank: int) -> torch.Tensor:
    """This ep rank's experts of the whole tensor ``full``."""
    n = spec.local_units
    return full.narrow(spec.dim, ep_rank * n, n)


__all__ = [
    "EXPERT_DIM_ATTR",
    "expert_dim",
    "expert_specs",
    "frozen_split",
    "local_experts",
    "stage0_writers",
]
