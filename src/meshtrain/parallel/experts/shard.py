"""Expert sharding (``parallelize`` step 3): each ep rank keeps its slice of every MoE layer.

For each experts module of a known family the fused weights are cut along dim 0 (the
expert dimension): ep rank ``r`` of ``P`` keeps experts ``[r L, (r + 1) L)``, ``L = E / P``,
in a :class:`RoutedExperts` that dispatches tokens over the ``ep`` group. The module keeps
its name and its parameters their names (``...mlp.experts.gate_up_proj``), so state-dict
keys do not change with ep; the slice each rank holds is ``param.meshtrain_expert_slice``
``(first, count, total)`` along dim 0, for checkpoints.

Known families: the experts module classes the rooms name (``Room.expert_classes``, in
``meshtrain.families``; ``FAMILIES``), and meshtrain's own ``RoutedExperts``:

==========================  ==================================================================
MixtralExperts              Mixtral: softmax -> top-k -> renormalise (router ``gate``)
Qwen2MoeExperts             Qwen2-MoE: softmax -> top-k (-> renormalise if ``norm_topk_prob``)
                            + a sigmoid-gated shared expert (replicated, not sharded)
Qwen3MoeExperts             Qwen3-MoE: as Qwen2-MoE without the shared expert
RoutedExperts               meshtrain's Decoder with ``model.moe`` (DeepSeek-style layer)
==========================  ==================================================================

The router and the shared experts stay replicated (they follow dp/ZeRO and tp as any other
weight). Any other module whose class name says it holds experts is refused by name: it
would otherwise run every expert on every rank while the user asked for ep.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.distributed.topology import Topology
from meshtrain.errors import ConfigError
from meshtrain.families.rooms import ROOMS
from meshtrain.parallel.experts import mark_expert_param
from meshtrain.parallel.experts.routed import RoutedExperts

FAMILIES: tuple[str, ...] = tuple(c for room in ROOMS for c in room.expert_classes)
SLICE_ATTR = "meshtrain_expert_slice"


def holds_experts(name: str, module: nn.Module) -> bool:
    """An experts container of a family not in FAMILIES: a class named like one, or a
    submodule called ``experts`` (older layouts: an ``nn.ModuleList`` of expert MLPs)."""
    return (
        type(module).__name__.endswith(("Experts", "NaiveMoe"))
        or name.rpartition(".")[2] == "experts"
    )


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every experts module of a known family; ConfigError
    naming the first unknown one."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts) or type(module).__name__ in FAMILIES:
            found.append((name, module))
        elif holds_experts(name, module) and not any(name.startswith(f + ".") for f, _ in found):
            raise ConfigError(
                f"mesh.expert_parallel_size: {name} ({type(module).__name__}) holds experts "
                f"meshtrain cannot shard; expert parallelism supports {', '.join(FAMILIES)} "
                "and meshtrain's Decoder (model.moe); set expert_parallel_size 1"
            )
    return found


def check_layout(model: nn.Module, topology: Topology) -> None:
    """Refuse, by name and before anything changes, expert parallelism of a model without
    MoE layers, or with an expert count ep does not divide, here rather than at step 3,
    so nothing (tp's sharding) has changed the model yet. Context parallelism runs MoE
    models (the auxiliary loss's sums combined over the cp ranks,
    ``parallel.experts.aux_loss``), under a pipeline too (the stages carry each cp rank's
    chunk's sums, combined over cp on the last stage, ``pipeline.router_aux``), and so do
    tensor parallelism (``parallel.tensor.moe_blocks``) and pipeline parallelism (checked
    by ``pipeline.router_aux``)."""
    if getattr(topology, "ep_size", 1) > 1:
        check_expert_counts(expert_modules(model), topology.ep_size)


def check_expert_counts(layers: list[tuple[str, nn.Module]], ep: int) -> None:
    """ConfigError unless ``layers`` (``expert_modules``) is not empty and ep divides every
    layer's expert count."""
    if not layers:
        raise ConfigError(
            f"mesh.expert_parallel_size: {ep} but the model has no mixture-of-experts "
            f"layer meshtrain knows ({', '.join(FAMILIES)}, or a Decoder with model.moe); "
            "set expert_parallel_size 1"
        )
    for name, module in layers:
        if module.num_experts % ep:
            raise ConfigError(
                f"mesh.expert_parallel_size: {ep} does not divide the {module.num_experts} "
                f"experts of {name}; pick an ep that divides the expert count"
            )


def _local_experts(w: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Experts ``[first, first + n)`` of ``w`` as a tensor of their own. Marked
    ``meshtrain_values_follow`` (``meshtrain.from_pretrained``: the loader writes every
    element after the layout), an uninitialised one: copying the untouched storage would
    write, and so make resident, this rank's whole slice beside the ZeRO storage it is
    copied into next (measured: +87 MiB a rank on a 212 MiB Mixtral at ep 2)."""
    if getattr(w, "meshtrain_values_follow", False):
        return torch.empty((n, *w.shape[1:]), dtype=w.dtype, device=w.device)
    return w.detach()[first : first + n].clone()


def apply_expert_parallel(model: nn.Module, topology: Topology) -> dict[int, nn.Parameter]:
    """Shard every experts module over ``topology.group("ep")`` in place; returns
    ``{id(full parameter): its shard}`` (for :func:`remap_parameters`). ConfigError when the
    model has no experts module or ep does not divide an expert count."""
    group = topology.group("ep")
    layers = expert_modules(model)
    check_expert_counts(layers, group.size)
    replaced: dict[int, nn.Parameter] = {}
    for name, module in layers:
        total = module.num_experts
        if module.gate_up_proj.shape[0] != total:
            raise ConfigError(
                f"{name}: already sharded ({module.gate_up_proj.shape[0]} of {total})"
            )
        n_local = total // group.size
        first = group.rank * n_local
        with torch.no_grad():
            gate_up, down = (
                _local_experts(w, first, n_local) for w in (module.gate_up_proj, module.down_proj)
            )
        sharded = RoutedExperts(
            gate_up, down, module.act_fn, total, group, first,
            getattr(module, "gemm", None),
        )  # fmt: skip
        sharded.train(module.training)
        for p, old in (
            (sharded.gate_up_proj, module.gate_up_proj),
            (sharded.down_proj, module.down_proj),
        ):
            mark_expert_param(p)
            setattr(p, SLICE_ATTR, (first, n_local, total))
            p.requires_grad_(old.requires_grad)
            replaced[id(old)] = p
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, sharded)
    return replaced


def remap_parameters(model_parameters, replaced: dict[int, nn.Parameter]):
    """``model_parameters`` (params or torch-style groups, taken before sharding) with each
    full expert weight swapped for this rank's shard."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**g, "params": [replaced.get(id(p), p) for p in g["params"]]} for g in items]
    return [replaced.get(id(p), p) for p in items]


__all__ = [
    "FAMILIES",
    "SLICE_ATTR",
    "apply_expert_parallel",
    "check_expert_counts",
    "check_layout",
    "expert_modules",
    "holds_experts",
    "remap_parameters",
]
