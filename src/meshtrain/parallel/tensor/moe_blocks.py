"""Mixture-of-experts blocks under tensor parallelism: attention is sharded, the MoE block
is not.

A MoE block is the module around an experts module (transformers' ``...SparseMoeBlock`` at
``model.layers.i.mlp``: its router ``gate``, the ``experts``, Qwen's ``shared_expert`` and
``shared_expert_gate``; meshtrain's ``Decoder`` ``layers.i.mlp``: ``router``, ``experts``,
``shared``). A TP plan's MLP rows (a ``region`` on ``...mlp`` and the column/row linears
inside it) would otherwise treat it as a dense MLP and sum its output over tp, although
every tp rank computes the whole of it. So ``apply_tensor_parallel`` leaves every module
inside a MoE block, and the block itself, as it is: the block runs on the hidden state
the rank holds there, the whole one (identical on the tp ranks) or, under sequence
parallelism, this rank's sequence shard.

What that costs and why it is exact (tp ``T``, ep ``P``, ``E`` experts, per layer and step;
``N`` = a replica's tokens, ``k`` = top-k, ``H`` = hidden size, ``b`` = element size):

* **Where the experts are.** ``Topology`` carves the ep groups out of the dp x cp ranks
  *of one tp index*: the ``T`` ranks of a tp group have the same ep index, so they hold
  the same experts (``L = E / P`` of them). Each tp index has its own ep groups, so the
  ``T`` token all-to-alls never meet: no collective of the MoE block crosses tp in
  forward.
* **Without sequence parallelism** every tp rank holds its replica's whole hidden state
  (the row-parallel attention output is all-reduced before the residual add), so the
  ``T`` ranks of a tp group route and dispatch the same ``N`` tokens identically: each
  sends ``2 (N k + R) H b`` under ``all_to_all`` on its ep group
  (``parallel.experts.dispatch``; ``R`` = rows its experts compute), as at tp 1, and the
  ``T`` ep groups of a replica move ``T`` times that in all: the price of duplicated
  tokens. Router, shared experts and experts see the same tokens on the ``T`` ranks, so
  their gradients are equal there and nothing sums them over tp (that would make them
  ``T`` times too large). The block's input gradient is the same full gradient on every
  tp rank, as a replicated norm's.
* **With sequence parallelism** (``tensor_parallel.sequence_parallel``) the hidden state
  between regions is this rank's ``1/T`` sequence shard, and the MoE block runs on it:
  each tp rank routes and dispatches only its ``N / T`` tokens, so the all-to-all bytes
  are ``2 (N k / T + R) H b`` per rank (``R`` = rows from the shards of the same tp index)
  and the duplicate dispatch is gone, with no collective added in forward. The block's
  parameters (router, shared experts, experts) then see different tokens on each tp
  rank, so :func:`sum_moe_grads_over` sums each one's gradient over tp as it is
  computed (``reduce_gradient_hook``, as sequence parallelism does for norms): one
  all-reduce per parameter and backward, ``2 x`` its bytes recorded under ``tp``, the
  experts' ``3 L F H b`` per layer included (the cost of keeping the experts whole over
  tp). The router's auxiliary loss counts every shard's tokens
  (``parallel.experts.aux_loss``), and the step log's tokens per expert are summed over
  tp too (``parallel.experts.load``).
* **Reductions over the replicas.** Router and shared experts are reduced over dp x cp,
  the experts over edp (divided by dp x cp, ``parallel.zero.stages``), per tp index, as
  at tp 1.
* **Clipping.** The global norm counts a parameter no plan sharded ``1/T`` on each tp
  rank (``parallel.tensor.grad_norm``); the block's gradients are equal over tp (whole
  tokens, or summed), so the experts and the router count once, the expert squares then
  summed over ep.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.experts.routed import RoutedExperts
from meshtrain.parallel.experts.shard import FAMILIES, holds_experts
from meshtrain.parallel.tensor.mappings import reduce_gradient_hook


def moe_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules holding an experts module (the MoE blocks), in
    module order. An experts module is one of a known family or any module that says it
    holds experts (``parallel.experts.shard``): under tp every family's block stays whole,
    ep or not."""
    blocks: list[str] = []
    for name, module in model.named_modules():
        known = isinstance(module, RoutedExperts) or type(module).__name__ in FAMILIES
        if not (known or holds_experts(name, module)) or inside(name, blocks):
            continue
        parent = name.rpartition(".")[0]
        if not parent:
            raise ConfigError(
                f"tensor parallelism: {name} ({type(module).__name__}) holds experts at the "
                "top of the model, with no MoE block around it that tensor parallelism "
                "could leave whole; set mesh.tensor_parallel_size 1"
            )
        blocks.append(parent)
    return blocks


def inside(name: str, blocks: list[str]) -> bool:
    """``name`` is one of ``blocks`` or a module inside one."""
    return any(name == b or name.startswith(b + ".") for b in blocks)


def match_rows(
    modules: dict[str, nn.Module], rows, blocks: list[str]
) -> tuple[dict[tuple, list[str]], set[str]]:
    """Each TP plan row's module names (fnmatch on its pattern) outside the MoE ``blocks``,
    and the row patterns that may match nothing here: those whose every match lies inside
    a block, and those under a ``region`` row that is a MoE block in this model (the
    plan's dense MLP rows apply to the dense layers only, and a model may have none:
    Mixtral)."""
    found = {row: [n for n in modules if fnmatch.fnmatchcase(n, row[0])] for row in rows}
    matched = {row: [n for n in names if not inside(n, blocks)] for row, names in found.items()}
    moe_regions = [
        row[0]
        for row, names in found.items()
        if row[1] == "region" and any(n in blocks for n in names)
    ]
    excused = {
        row[0]
        for row, names in found.items()
        if names or any(row[0].startswith(r + ".") for r in moe_regions)
    }
    return matched, excused


def sum_moe_grads_over(model: nn.Module, group) -> bool:
    """Sequence parallelism: sum the gradient of every parameter inside a MoE block over
    ``group`` (the tp group) as it is computed; call it after expert sharding, which
    replaces the experts' parameters. The hooks join the ones ``remove_tensor_parallel``
    removes. False (nothing registered) for a model without MoE blocks."""
    blocks = moe_blocks(model)
    if not blocks or group.size == 1:
        return bool(blocks)
    changes = getattr(model, "meshtrain_tp_changes", None)
    seen: set[int] = set()
    for name in blocks:
        for p in model.get_submodule(name).parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                handle = p.register_hook(reduce_gradient_hook(group))
                if changes is not None:
                    changes.handles.append(handle)
    return True


__all__ = ["inside", "moe_blocks", "sum_moe_grads_over"]
