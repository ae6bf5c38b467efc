"""``parallelize(model, topology, config)``: every parallelism decision, in one fixed order.

::

    place      model.to(device, dtype); in fp32 frozen parameters keep their dtype
               (``parallel.placement``)
    1. TP      tensor-parallel plan: swap linears/embeddings for sharded ones
    2. CP      context-parallel attention: each attention layer spans the cp group
               (ring or all_to_all) and a pre-hook cuts every batch to this rank's chunks
    3. EP      expert sharding: each ep rank keeps its slice of the experts and
               dispatches tokens to them by all-to-all (``parallel.experts``)
    4. PP      pipeline split: keep this stage's layers only
    4b. fp8    float8 linear layers (torchao), when fp8.enabled
    5. AC      activation checkpointing of each block
    6. compile torch.compile (lazy: traced at the first forward)
    7. DP/ZeRO broadcast rank 0's weights over dp, flatten into buckets, install the
               gradient reducer (and ZeRO-3's gathering hooks)

Why this order (torchtitan's, for the same reasons):

* TP first: it changes what the parameters *are* (shapes, which rank holds what). Every
  later step (the pipeline's balance by parameter count, the checkpointed blocks, the
  flat buffers) must see the sharded parameters, never the full ones.
* CP after TP: it swaps the attention *computation* (ring or all-to-all over the cp
  group) inside the already tensor-parallel attention module, whose heads are this tp
  rank's; it adds no parameters, so nothing after it sees a difference in shapes.
* EP after CP, before PP: expert sharding, like TP, changes which parameters a rank holds
  (its slice of the experts), so the pipeline's balance and the flat buffers must see it;
  it comes after TP and CP because the router and dispatch see the activations those
  produce (tokens of this rank's sequence chunk). TP leaves MoE blocks whole; under
  sequence parallelism their gradients are summed over tp by hooks registered after EP,
  which replaces the experts' parameters (``parallel.tensor.moe_blocks``).
* PP before AC and DP: a rank checkpoints, flattens and reduces only the layers of its
  own stage; flattening first would allocate buffers for layers the rank drops.
* AC before compile: the checkpoint wrapper is part of what gets traced, so the compiled
  graph recomputes instead of saving (torchtitan's order).
* compile before the DP/ZeRO wrap: the wrap works through hooks (gradient-accumulation
  hooks on parameters; ZeRO-3 module hooks that swap ``param.data``) and through
  parameter storage, not by wrapping ``forward``. ``nn.Module.compile`` only marks the
  module: tracing happens at the first forward, when every hook exists, so the graph
  sees the module exactly as it will run. Compiling the module after the wrap would be
  equivalent; this order keeps the documented one.
* DP/ZeRO last: it owns the parameters' storage (flat buckets, shards), which must be
  laid out over the final set of parameters. With CP the replicas are dp x cp (the
  ``dp_cp`` group); expert parameters are reduced over ``edp`` instead.

A step that is not built raises ConfigError naming its key before the model changes.

Pipeline parallelism (``meshtrain.parallel.pipeline``) composes with tensor parallelism
inside each stage and data parallelism with ZeRO 0-2 over dp (pp x dp x tp on one mesh):
step 1 shards the whole model, step 2 cuts the sharded model, so every tp rank of a
stage holds the same blocks and sends its own copy of the activation to the same tp
rank of the next stage. ZeRO 3 under a pipeline raises ConfigError before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.distributed import comm
from meshtrain.distributed.topology import Topology
from meshtrain.dtypes import PRECISIONS
from meshtrain.errors import ConfigError
from meshtrain.optim.builders import param_groups
from meshtrain.parallel.experts import is_expert_param
from meshtrain.parallel.placement import place_model
from meshtrain.parallel.zero.stage import ZeroStage


@dataclass
class Parallelized:
    """What the Engine steps: the model as it runs, its optimizer param groups (over this
    rank's parameters), and the data-parallel / ZeRO stage that owns their storage."""

    module: nn.Module
    groups: list[dict]
    zero: ZeroStage  # one part, or with experts two (the experts reduced over edp)
    pipeline: object | None = None  # PipelineRuntime when pp > 1


def parallelize(
    model: nn.Module, topology: Topology, config, model_parameters=None, *, tp_plan=None
) -> Parallelized:
    """Apply the configured parallelism to ``model`` in place (see the module docstring).

    ``model_parameters`` is what a user passes to ``initialize``: parameters, or torch-style
    param-group dicts (default: every parameter of the model in one group). ``tp_plan``: a
    ``meshtrain.parallel.tensor.TPPlan`` for a model without a built-in plan.
    """
    model = place_model(model, topology.device, PRECISIONS[config.precision])

    from meshtrain.parallel.experts.shard import check_layout

    check_layout(model, topology)  # MoE layers under tp or cp: refused by name, up front
    if topology.pp_size > 1:  # what a pipeline cannot combine with, before anything changes
        from meshtrain.parallel.pipeline.engine_step import check_pipeline

        check_pipeline(model, topology, config)
    if topology.cp_size > 1:  # what context parallelism cannot combine with, likewise
        from meshtrain.parallel.context.apply import check_context_parallel

        check_context_parallel(model, topology, config)
    # 1. tensor parallelism: changes the parameters themselves, so it comes first
    if config.mesh.tensor_parallel_size not in (1, topology.tp_size):
        raise ConfigError(
            f"mesh.tensor_parallel_size {config.mesh.tensor_parallel_size} != the topology's "
            f"tp size {topology.tp_size}; build the Topology from the config (or leave "
            "topology= out of initialize)"
        )
    if topology.tp_size > 1:
        from meshtrain.parallel.tensor.apply import apply_tensor_parallel, remap_parameters

        apply_tensor_parallel(model, topology, config, plan=tp_plan)
        model_parameters = remap_parameters(model_parameters, model)
    # 1b. chunked loss: on the head as TP left it (vocab rows of this rank), before ZeRO
    # wraps it (its forward then runs inside the head's gather)
    if config.loss.chunked:
        from meshtrain.loss.chunked_head import apply_chunked_loss, check_layout

        check_layout(config, topology)
        group = topology.tp_group if topology.tp_size > 1 else None
        apply_chunked_loss(model, config.loss.chunk_size, group)
    # 2. context-parallel attention: replaces how attention is computed (not what the
    # parameters are), inside the tp-sharded attention of step 1
    if topology.cp_size > 1:
        from meshtrain.parallel.context.apply import apply_context_parallel

        apply_context_parallel(model, topology, config)
    elif config.mesh.context_parallel_size > 1:
        raise ConfigError(
            f"mesh.context_parallel_size: {config.mesh.context_parallel_size} but the "
            f"topology has cp={topology.cp_size}; build the Topology from the config"
        )
    # 3. expert sharding: changes which expert parameters a rank holds, so it comes
    # before anything that counts or lays out parameters (pipeline balance, flat buffers)
    if topology.ep_size > 1:
        from meshtrain.parallel.experts.shard import apply_expert_parallel, remap_parameters

        replaced = apply_expert_parallel(model, topology)
        model_parameters = remap_parameters(model_parameters, replaced)
    # sequence parallelism hands each tp rank's MoE blocks a sequence shard: their
    # gradients (the experts' too, as EP left them) are summed over tp
    shards = None
    if (getattr(model, "meshtrain_tp", None) or {}).get("sequence_parallel"):
        from meshtrain.parallel.tensor.moe_blocks import sum_moe_grads_over

        shards = topology.tp_group if sum_moe_grads_over(model, topology.tp_group) else None
    # the router's load-balancing loss: by default each replica's own micro-batch's, as
    # DDP / DeepSpeed / accelerate backpropagate the loss the model returns; with
    # loss.global_aux_loss over every replica's tokens, as one process on the whole batch
    # computes it (it is not linear in the batch; see parallel.experts.aux_loss). Under
    # sequence parallelism a replica's tokens are spread over its tp ranks, so their sums
    # are always combined, and so under context parallelism are a replica's cp chunks
    # (its cp ranks hold one replica's rows). (Under a pipeline the stages do it:
    # ``router_aux``.)
    replicas = topology.replica_group if config.loss.global_aux_loss else None
    if replicas is None and topology.cp_size > 1:
        replicas = topology.cp_group
    replicas = replicas if replicas is not None and replicas.size > 1 else None
    if (replicas is not None or shards is not None) and topology.pp_size == 1:
        from meshtrain.parallel.experts.aux_loss import reduce_aux_loss_over

        reduce_aux_loss_over(model, replicas, shards)
    # 4. pipeline split: a rank keeps only its stages before anything is allocated for them
    pipeline = None
    if topology.pp_size > 1:
        from meshtrain.parallel.pipeline.engine_step import local_parameters, split_for_engine

        model, pipeline = split_for_engine(model, topology, config)
        model_parameters = local_parameters(model_parameters, model)
    elif config.mesh.pipeline_parallel_size > 1:
        raise ConfigError(
            f"mesh.pipeline_parallel_size: {config.mesh.pipeline_parallel_size} but the "
            f"topology has pp={topology.pp_size}; build the Topology from the config"
        )
    # 4b. float8 linears (fp8.enabled): this rank's layers only, before AC and compile trace them
    if config.fp8.enabled:
        from meshtrain.parallel.float8 import apply_float8

        apply_float8(model, config.fp8, topology.device, topology.tp_size)
    # 5. activation checkpointing: wraps each block's forward, before it is traced
    ac = config.activation_checkpointing
    if ac.enabled:
        from meshtrain.parallel.activation_checkpointing import apply_activation_checkpointing

        # the default blocks are a module's first block list: a rank running several
        # stages (interleaved) has one list per stage, each to be checkpointed
        stages = getattr(model, "stages", None) if pipeline is not None else None
        parts = [model] if stages is None or ac.module_classes else list(stages.values())
        for part in parts:
            apply_activation_checkpointing(part, ac.module_classes)
    # 6. compile: lazy, so the hooks installed in step 7 are traced at the first forward
    c = config.compile
    if c.active:
        model.compile(
            backend=c.backend,
            mode=c.mode,
            fullgraph=c.fullgraph,
            dynamic=c.dynamic,
            options=c.options,
            **c.kwargs,
        )
    # 7. data parallelism / ZeRO: every replica starts from rank 0's weights, then the
    # trainable parameters move into flat buckets (sharded by stage)
    _broadcast(model, topology)
    groups = param_groups(model, model_parameters)
    return Parallelized(model, groups, ZeroStage(model, groups, config, topology), pipeline)


def _broadcast(model: nn.Module, topology: Topology) -> None:
    """Start every replica from its group's first rank's weights and buffers (over dp x cp,
    ``topology.replica_group``: cp ranks hold the same weights too). A
    model whose every rank reads the same files next (``meshtrain.from_pretrained`` sets
    ``meshtrain_weights_from_files``) skips it: it would write the whole model on every
    rank but 0, the very copy sliced loading avoids. Expert parameters
    (``parallel.experts``) differ between ep ranks: they come from their ``edp`` group's
    first rank instead."""
    if getattr(model, "meshtrain_weights_from_files", False):
        return
    replicas, edp = topology.replica_group, topology.group("edp")
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            group = edp if is_expert_param(t) else replicas
            if group.size > 1:
                comm.broadcast(t.data, 0, group, label="init")


__all__ = ["Parallelized", "parallelize"]
