"""Mixture-of-experts blocks under tensor parallelism: attention is sharded, the MoE block
is not.

A MoE block is the module around an experts module (transformers' ``...SparseMoeBlock`` at
``model.layers.i.mlp``: its router ``gate``, the ``experts``, Qwen's ``shared_expert`` and
``shared_expert_gate``; meshtrain's ``Decoder`` ``layers.i.mlp``: ``router``, ``experts``,
``shared``). A TP plan's MLP rows (a ``region`` on ``...mlp`` and the column/row linears
inside it) would otherwise treat it as a dense MLP and sum its output over tp, although
every tp rank computes the whole of it. So ``apply_tensor_parallel`` leaves every module
inside a MoE block, and the block itself, as it is: the block runs on the full hidden
state, which every rank of the tp group holds identically (the row-parallel attention
output is all-reduced before the residual add, the norm after it is replicated).

What that costs and why it is exact (tp ``T``, ep ``P``, per layer and step):

* **Where the experts are.** ``Topology`` carves the ep groups out of the dp x cp ranks
  *of one tp index*: the ``T`` ranks of a tp group have the same ep index, so they hold
  the same experts (``L = E / P`` of them) and, holding the same tokens, route and dispatch
  identically. Each tp index has its own ep groups, so the ``T`` copies of the token
  all-to-all never meet: no collective of the MoE block crosses tp.
* **Bytes.** Each rank sends exactly what it would at tp 1 with the same tokens:
  ``2 (N k + R) H b`` under ``all_to_all`` on its ep group (``parallel.experts.dispatch``),
  ``N`` = this replica's tokens (its full sequence). The ep groups of a replica move
  ``T`` times that in all: the price of not splitting the tokens over tp. Splitting them
  (each tp rank dispatching ``1/T`` of the tokens, i.e. sequence parallelism around the
  block) would divide the all-to-all bytes by ``T`` for an all-gather of the block output
  over tp; it is not built, and ``tensor_parallel.sequence_parallel`` with a MoE model is
  refused by name.
* **Gradients.** The router, the shared experts and the experts are replicated over tp and
  see the same tokens, so their gradients are equal on the ``T`` ranks: nothing sums them
  over tp (that would make them ``T`` times too large). The router and shared experts are
  reduced over the replicas (dp x cp), the experts over edp (divided by dp x cp,
  ``parallel.zero.stages``), per tp index, as at tp 1. The block's input gradient is the
  same full gradient on every tp rank, as a replicated norm's; the next region's
  ``copy_to_region`` all-reduces only the column layers' partial sums.
* **Clipping.** The global norm counts a parameter no plan sharded ``1/T`` on each tp
  rank (``parallel.tensor.grad_norm``): the experts and the router count once, the expert
  squares then summed over ep.
"""

from __future__ import annotations

from torch import nn

from meshtrain.errors import ConfigError


def moe_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules holding an experts module (the MoE blocks), in
    module order. An experts module is one of a known family or any module that says it
    holds experts (``parallel.experts.shard``): under tp every family's block stays whole,
    ep or not."""
    from meshtrain.parallel.experts.routed import RoutedExperts
    from meshtrain.parallel.experts.shard import FAMILIES, _holds_experts

    blocks: list[str] = []
    for name, module in model.named_modules():
        known = isinstance(module, RoutedExperts) or type(module).__name__ in FAMILIES
        if not (known or _holds_experts(name, module)) or inside(name, blocks):
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


def check_sequence_parallel(blocks: list[str], sequence_parallel: bool) -> None:
    """Sequence parallelism would hand each MoE block a sequence shard: routing,
    dispatch and gradients on shards (summed over tp) are not built."""
    if blocks and sequence_parallel:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel: true with a mixture-of-experts model "
            f"({blocks[0]} and {len(blocks) - 1} more MoE blocks): sequence parallelism "
            "around MoE blocks is not built; set tensor_parallel.sequence_parallel to false "
            "(tensor parallelism of attention composes with expert parallelism without it)"
        )


__all__ = ["check_sequence_parallel", "inside", "moe_blocks"]
