"""The pipeline's part of the Engine: splitting in ``parallelize``, and the schedule of a
window for ``train_batch`` / ``eval_batch`` (``engine.batches``).

``split_for_engine`` is ``parallelize``'s step 2: it cuts the model (a
``meshtrain.pipe.PipelineModule`` is already cut; any other model is split with
``split_model``) and returns ``PipelineStages``, the module holding this rank's stages
(what activation checkpointing, compile and the data-parallel wrap then see), with the
``PipelineRuntime`` that runs them. The storage of the blocks other ranks run is released
(the model object given to ``initialize`` cannot run whole afterwards).

``run_window(engine, batches)`` runs the schedule over one window of micro-batches through
the Engine's window driver (``engine.window.schedule``); ``engine.train_batch`` pulls the
micro-batches and steps once after it. Under ZeRO 0 and 1 the data-parallel reduction runs once after
the schedule (the micro-batches' backwards interleave with forwards, so no backward is
"the last one"): hooks are told not to reduce, and the step's ``finish`` reduces every
bucket over the stage's dp group (each stage has its own: ranks ``dp * tp`` apart hold
the same stage). Under ZeRO 2 every micro-batch's backward on a stage reduce-scatters
the stage's buckets into the gradient shard and drops ``.grad`` (``m`` reduce-scatters per
step instead of one, as ZeRO 2 does with gradient accumulation; with ``v`` chunks per rank
each chunk's backward reduces the rank's whole flat group, so ``v m``). Under ZeRO 3
each stage's units are gathered once per run of consecutive actions on it in the rank's
action list (once per step with one stage per rank) and its gradients reduce-scattered
once after the schedule (``parallel.zero.pipeline_gather``). Tensor parallelism runs inside each stage (``parallelize``'s step 1
shards before step 2 cuts; the vocab-parallel loss runs on the last stage). With sequence
parallelism the activation crossing a stage boundary is each tp rank's ``1/T`` sequence
shard, ``b x t/T x d`` instead of ``b x t x d`` each way (``SplitStage.forward`` runs a
later stage's blocks on it); every micro-batch's length must divide by ``T``, checked on
every rank before the schedule starts (``check_sequence_lengths``).
With dp > 1 each replica pulls its own micro-batches (the data loader deals them by dp
rank; the stages of one replica must see the same batches); ``engine.batches`` averages
the loss over the replicas.

The gradient norm and the tied weights' sums across stages are ``grads``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtrain.errors import ConfigError, TopologyError
from meshtrain.parallel.pipeline.grads import global_grad_norm, sum_tied_shards
from meshtrain.parallel.pipeline.runtime import PipelineRuntime
from meshtrain.parallel.pipeline.schedules import V_SHAPED, stage_rank

__all__ = [
    "check_pipeline",
    "check_sequence_lengths",
    "global_grad_norm",
    "run_eval_window",
    "run_window",
    "split_for_engine",
]


class PipelineStages(nn.Module):
    """This rank's stages; ``stages[str(k)]`` is stage ``k``. Calling it is an error: run
    ``engine.train_batch`` / ``eval_batch``, which follow the schedule."""

    def __init__(self, stages: dict[int, nn.Module], has_routed_experts: bool = False) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({str(k): s for k, s in stages.items()})
        # the whole model's, not this rank's stages': every rank then logs expert load
        # (``parallel.experts.load``), a stage without MoE layers included
        self.has_routed_experts = has_routed_experts

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            "with mesh.pipeline_parallel_size > 1 the model runs in a pipeline schedule: "
            "call loss = engine.train_batch(data_iter) / engine.eval_batch(data_iter) "
            "instead of engine(batch), engine.backward(loss), engine.step()"
        )


def check_pipeline(model: nn.Module, topology, config) -> None:
    """What pipeline parallelism does not combine with, refused before ``parallelize``
    changes anything: sequence parallelism with a ``PipelineModule`` (its tensor
    parallelism is per layer kind, without SP) or for a model whose layout cannot send
    sequence shards (GPT-2)."""
    from meshtrain.parallel.pipeline.module import PipelineModule
    from meshtrain.parallel.pipeline.router_aux import check_pipeline_moe
    from meshtrain.parallel.pipeline.split import find_layout, known_layout

    check_pipeline_moe(model, topology)
    if topology.tp_size == 1:
        return
    if isinstance(model, PipelineModule):
        # its plan comes from its layers (``PipelineModule.tensor_parallel_plan``)
        if config.tensor_parallel.sequence_parallel:
            raise ConfigError(
                f"tensor_parallel.sequence_parallel with mesh.tensor_parallel_size="
                f"{topology.tp_size} and a meshtrain.pipe.PipelineModule is not "
                "implemented (its layer list has no point where the sequence is split and "
                "gathered again); set sequence_parallel to false, or let meshtrain split a "
                "model with a built-in plan"
            )
        return
    if config.tensor_parallel.sequence_parallel and known_layout(model) is None:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel with mesh.pipeline_parallel_size > 1 is not "
            f"implemented for {type(model).__name__}: it has no known block list, and its "
            "traced split does not know where a stage's activation is a sequence shard; set "
            "tensor_parallel.sequence_parallel to false"
        )
    if config.tensor_parallel.sequence_parallel and not find_layout(model).sequence_shards:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel with mesh.pipeline_parallel_size > 1 is not "
            f"implemented for {type(model).__name__}: its forward reshapes the hidden states "
            "to the full sequence length after the final norm, which a stage before the last "
            "does not gather, so the sequence shard it sends would be misshaped; set "
            "tensor_parallel.sequence_parallel to false (Llama, Qwen2, Mistral, BERT and the "
            "meshtrain decoder support it under a pipeline)"
        )


def split_for_engine(model: nn.Module, topology, config) -> tuple[PipelineStages, PipelineRuntime]:
    """Step 2 of ``parallelize``: this rank's stages and the runtime that schedules them."""
    from meshtrain.parallel.experts.routed import RoutedExperts
    from meshtrain.parallel.pipeline.module import PipelineModule
    from meshtrain.parallel.pipeline.router_aux import attach_router_aux
    from meshtrain.parallel.pipeline.split import free_unused, known_layout, split_model
    from meshtrain.parallel.pipeline.tied import tied_groups
    from meshtrain.parallel.pipeline.traced import split_traced

    pc = config.pipeline
    p, v = topology.pp_size, int(pc.virtual_stages)
    routed = any(isinstance(m, RoutedExperts) for m in model.modules())
    if pc.schedule in V_SHAPED and v != 2:
        raise ConfigError(
            f"pipeline.schedule: {pc.schedule} holds two stages per rank in a V (rank r "
            f"runs stages r and 2p-1-r), got pipeline.virtual_stages {v}; set it to 2"
        )
    gas = config.gradient_accumulation_steps
    if pc.schedule == "dualpipev" and isinstance(gas, int) and gas < 2 * p:
        raise ConfigError(
            f"pipeline.schedule: dualpipev needs at least 2 x pp = {2 * p} micro-batches per "
            f"step, got gradient_accumulation_steps {gas}; raise it or use zbv"
        )
    if isinstance(model, PipelineModule) and pc.schedule in V_SHAPED:
        raise ConfigError(
            f"pipeline.schedule: {pc.schedule} with a meshtrain.pipe.PipelineModule is not "
            "implemented (a PipelineModule places its stages looped, s % p, not in a V); "
            "use interleaved_1f1b or zb_h1, or let meshtrain split the model"
        )
    if isinstance(model, PipelineModule):
        if model.num_stages != p * v:
            raise ConfigError(
                f"PipelineModule has {model.num_stages} stages but the mesh asks for "
                f"pp {p} x pipeline.virtual_stages {v}; build it with topology= and "
                f"virtual_stages={v}"
            )
        stages, tied = model.stages, model.tied
    else:
        # under sequence parallelism a stage's activation may be its tp rank's 1/T
        # sequence shard (Megatron's): ``SplitStage.forward`` runs later stages on it
        sp = topology.tp_size > 1 and bool(config.tensor_parallel.sequence_parallel)
        if known_layout(model) is None:  # no block list: cut its traced forward (``traced``)
            every = split_traced(model, p * v, method=pc.partition_method, cut_points=pc.cut_points)
        else:
            every = split_model(
                model, p * v, method=pc.partition_method, cut_points=pc.cut_points,
                sequence_parallel=sp,
            )  # fmt: skip
        place = pc.schedule  # looped (s % p) or, for zbv / dualpipev, a V
        mine = [k for k in range(p * v) if stage_rank(place, k, p) == topology.pp_rank]
        stages = {k: every[k] for k in mine}
        # MoE: the router's auxiliary loss over every stage's layers (``router_aux``), over
        # every replica's tokens only with loss.global_aux_loss (``compose``'s rule)
        # (by default the replica's own rows; under cp those are its cp ranks' chunks, whose
        # sums are combined over the cp group, as ``compose`` does without a pipeline)
        replicas = topology.replica_group if config.loss.global_aux_loss else None
        if replicas is None and topology.cp_size > 1:
            replicas = topology.cp_group
        chunks = topology.cp_group if topology.cp_size > 1 else None
        attach_router_aux(stages.values(), model, replicas, chunks)
        tied = tied_groups(every, topology, lambda k: stage_rank(place, k, p))
        free_unused(model, list(stages.values()))  # other ranks' blocks: storage released
    runtime = PipelineRuntime(
        stages, topology.pp_group, p * v, pc.schedule, tied, device=topology.device
    )
    return PipelineStages(stages, routed), runtime


def local_parameters(model_parameters, module: nn.Module):
    """``model_parameters`` (parameters or param-group dicts, as given to ``initialize``)
    restricted to the parameters of this rank's stages; None stays None."""
    if model_parameters is None:
        return None
    mine = {id(p) for p in module.parameters()}
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=[p for p in g["params"] if id(p) in mine]) for g in items]
    return [p for p in items if id(p) in mine]


def run_window(
    engine, batches: list, weights: list[float] | None = None, loss_fn=None
) -> torch.Tensor:
    """The schedule's forwards and backwards over the window ``batches`` (on the engine's
    device), gradients reduced as the ZeRO stage says, up to (not including)
    ``engine.step()``; returns this replica's loss on every pp rank: the mean over the
    micro-batches, or ``sum_i weights[i] * loss_i`` (``PipelineRuntime.train_step``);
    ``loss_fn(outputs, i)``: micro-batch ``i``'s loss from the last stage's whole outputs
    (``train_step``; the Trainer's ``compute_loss``)."""
    pipe: PipelineRuntime = engine.pipeline
    check_sequence_lengths(engine, batches)
    for b in batches:  # samples/s and tokens/s of the step log
        args, kwargs = ((), b) if isinstance(b, dict) else (tuple(b), {})
        engine.log.count_batch(args, kwargs)
    zero = engine.zero
    attach_stage_gathering(engine)
    engine.shorten_window(1)  # the schedule runs the whole window; the next step() ends it

    def schedule(loss_scale: float, after_backward) -> torch.Tensor:
        # ZeRO 0-1: reduce once, after the schedule; ZeRO 2: after every micro-batch's
        # backward (no rank keeps a full gradient to accumulate into): the window's rule
        return pipe.train_step(
            batches,
            loss_scale=loss_scale,
            after_backward=after_backward,
            weights=weights,
            loss_fn=loss_fn,
            tied_summed=zero.every_backward,
        )

    with engine.log.timed("forward"):  # forward and backward interleave
        loss = engine.window.schedule(schedule)
    if zero.every_backward:
        sum_tied_shards(pipe.tied, zero, engine.topology.dp_group)
    return loss


def attach_stage_gathering(engine) -> None:
    """ZeRO-3: the runtime gathers each stage's units per run of its action list
    (``parallel.zero.pipeline_gather``), built once from the engine's gatherers."""
    pipe: PipelineRuntime = engine.pipeline
    found = engine.zero.gatherers
    if pipe.gathering is not None or not found:
        return
    from meshtrain.parallel.zero.pipeline_gather import StageGathering

    pipe.gathering = StageGathering(found, pipe.stages)


def check_sequence_lengths(engine, batches: list) -> None:
    """Under sequence parallelism every micro-batch's sequence length must split over the
    tp ranks. Checked on every rank before the schedule posts a receive: otherwise only
    the first stage's scatter raises, and the next stages wait on sends that never come."""
    t = engine.topology.tp_size
    if t == 1 or not engine.config.tensor_parallel.sequence_parallel:
        return
    for i, b in enumerate(batches):
        ids = b.get("input_ids") if isinstance(b, dict) else b[0]
        if isinstance(ids, torch.Tensor) and ids.dim() > 1 and ids.shape[1] % t:
            raise TopologyError(
                f"micro-batch {i} of this step has sequence length {ids.shape[1]}: with "
                f"tensor_parallel.sequence_parallel the sequence length must be a multiple of "
                f"tensor_parallel_size {t}; pad every batch to a multiple of {t} (e.g. a "
                f"collator's pad_to_multiple_of={t})"
            )


@torch.no_grad()
def run_eval_window(engine, batches: list) -> torch.Tensor:
    """The schedule's forwards over ``batches`` without gradients (``eval_step``); this
    replica's mean loss on every pp rank."""
    pipe: PipelineRuntime = engine.pipeline
    check_sequence_lengths(engine, batches)
    attach_stage_gathering(engine)
    return pipe.eval_step(batches)
