"""ZeRO stages 0-3 as storage plans over ``FlatGroup`` (Rajbhandari et al., 2020).

``zero_optimization.stage`` picks what is partitioned over the ``N`` data-parallel ranks;
the training script does not change. For ``Psi`` trainable parameters, ``s`` bytes per
model element (4 fp32, 2 bf16/fp16) and ``K`` optimizer bytes per parameter (Adam: 8 in
fp32, 12 with a 16-bit model because the fp32 master is separate), a rank holds:

=======  ==============================  =================================================
stage    model states per rank            what moves per optimizer step (comm convention)
=======  ==============================  =================================================
0        s Psi + s Psi + K Psi            all-reduce of gradients: 2 s Psi
1        s Psi + s Psi + K Psi / N        reduce-scatter of gradients s Psi + all-gather of
                                         updated parameters s Psi = 2 s Psi
2        s Psi + (s + K) Psi / N          the same 2 s Psi; gradients are reduce-scattered
                                         bucket by bucket during *every* backward (with
                                         gradient accumulation k: (k + 1) s Psi)
3        (s + s + K) Psi / N              all-gather before each unit's forward s Psi,
         (+ the units gathered at once)  again before its backward s Psi, reduce-scatter
                                         of gradients s Psi: 3 s Psi = 1.5 x stage 0
                                         (per micro-step: 3 k s Psi with accumulation k)
=======  ==============================  =================================================

Frozen parameters (``Phi`` elements, e.g. a LoRA base model) add ``s Phi`` per rank at
stages 0-2 and no traffic; at stage 3 they are sharded too (``zero.frozen``): ``s Phi / N``
per rank, gathered for forward (and backward, where the unit's outputs need a
gradient) like trainable units, never reduced and never stepped.

Counting convention: ``meshtrain.distributed.comm`` records an all-reduce of ``b`` bytes as
``2b`` and a reduce-scatter / all-gather as the bytes of the full buffer, the ZeRO paper's
communication volume; ``Psi`` above is the *padded* flat size (each bucket rounded up to
a multiple of ``N``; stage 0 pads nothing). The scalar all-reduce of the gradient norm
is recorded under ``control`` and is not part of these figures. The figures count the
*logical* reduce-scatters and all-gathers: on CPU (gloo) ``distributed/comm.py``
runs them as an in-place all-reduce and per-rank broadcasts, which are faster there, and
records them under the same names and bytes, so this table holds on every backend.

Offload: ``offload_optimizer.device = "cpu"`` keeps the fp32 masters and optimizer states
of this rank's shard in (pinned, on CUDA) host memory and steps there; gradients travel
to it and updated values back. ``offload_param.device = "cpu"`` (stage 3) keeps the
parameter shard on the host; a unit's shard is copied to the device just before its
all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.distributed.topology import Group, Topology
from meshtrain.optim.catalog import layout_of
from meshtrain.parallel.blocks import gather_units
from meshtrain.parallel.zero.flat_group import SLICE_NUMEL, FlatGroup
from meshtrain.parallel.zero.frozen import FrozenGroup, frozen_groups
from meshtrain.parallel.zero.quantized import (
    keep_4bit_layout_fixed,
    track_8bit_codes,
    unpin_8bit_codes,
)
from meshtrain.parallel.zero.stage3 import ParamGatherer, assign_units

_UNBOUNDED = 1 << 62


@dataclass
class ZeroPlan:
    """The flat groups of each optimizer param group, plus the stage-3 gatherer and the
    stage-3 shards of frozen parameters (``zero.frozen``; empty below stage 3)."""

    per_group: list[list[FlatGroup]]
    gatherer: ParamGatherer | None
    frozen_groups: list[FrozenGroup]

    @property
    def flat_groups(self) -> list[FlatGroup]:
        return [fg for fgs in self.per_group for fg in fgs]


def _slice_numel(config, master_device: torch.device) -> int:
    """Optimizer leaves of at most ``SLICE_NUMEL`` elements bound an element-wise
    optimizer's temporaries (``flat_group``'s docstring); torch's fused kernels make none,
    and there each extra leaf only costs the optimizer's per-tensor Python work (on the
    ~1B decoder, 3.6k slices added ~18 ms to a 375 ms H200 step), so one leaf per chunk."""
    from meshtrain.optim.optimizers import runs_fused

    cfg = config.optimizer
    if cfg is None:  # the user's own optimizer: unknown, keep the bound
        return SLICE_NUMEL
    params = (
        cfg.params if isinstance(cfg.params, dict) else cfg.params.model_dump(exclude_none=True)
    )
    return _UNBOUNDED if runs_fused(cfg.type, params, master_device.type) else SLICE_NUMEL


def _offloaded(section) -> bool:
    return section is not None and section.device == "cpu"


def _quantized_base(model: nn.Module) -> list[nn.Module]:
    """Stage 3 and a bitsandbytes-quantized base (``zero.quantized``): 4-bit weights keep
    one layout; 8-bit ones lose bitsandbytes' pinned copy of their codes. Returns the 8-bit
    linears, whose ``state.CB`` is re-pointed at each gather (``track_8bit_codes``)."""
    keep_4bit_layout_fixed(model)
    return unpin_8bit_codes(model)


def build_plan(
    model: nn.Module,
    groups: list[dict],
    config,
    topology: Topology,
    stage: int,
    replicas: Group,
    frozen_select=None,
) -> ZeroPlan:
    """Lay out the trainable parameters of ``groups`` for ``stage`` over ``replicas``
    (see the module docstring)."""
    z = config.zero_optimization
    partitions = replicas.size if stage >= 1 else 1  # shards over the ranks of one copy
    rank = replicas.rank if partitions > 1 else 0
    master_device = torch.device("cpu") if _offloaded(z.offload_optimizer) else None
    common = dict(
        partitions=partitions,
        rank=rank,
        shard_grads=stage >= 2,
        master_device=master_device,
        separate_master=_offloaded(z.offload_optimizer),
        slice_numel=_slice_numel(config, master_device or topology.device),
    )
    # the optimizer decides how master chunks are cut (optim.catalog: 8-bit blocks, whole)
    common["layout"] = layout_of(config.optimizer.type if config.optimizer else None)
    bucket = int(z.reduce_bucket_size)
    if stage < 3:
        per_group = [[FlatGroup(g["params"], bucket_numel=bucket, **common)] for g in groups]
        return ZeroPlan(per_group, None, [])

    units = gather_units(model, list(z.stage3_module_classes))
    owner = assign_units(model, units, int(z.stage3_param_persistence_threshold))
    param_device = torch.device("cpu") if _offloaded(z.offload_param) else None
    per_group, sharded = [], []
    for g in groups:
        mine = [p for p in g["params"] if p in owner]
        whole = [p for p in g["params"] if p not in owner]
        fgs = []
        if mine:
            fg = FlatGroup(
                mine,
                bucket_numel=_UNBOUNDED,  # one bucket per unit: one all-gather per use
                shard_params=True,
                param_device=param_device,
                keys=[owner[p] for p in mine],
                **common,
            )
            fgs.append(fg)
            sharded.append(fg)
        if whole:  # persistent: small or outside every unit; stage-2 treatment
            fgs.append(FlatGroup(whole, bucket_numel=bucket, **common))
        per_group.append(fgs)
    int8_linears = _quantized_base(model)
    frozen = frozen_groups(
        units,
        int(z.stage3_param_persistence_threshold),
        partitions=partitions,
        rank=rank,
        param_device=param_device,
        select=frozen_select,
    )
    gatherer = None
    if sharded or frozen:
        gatherer = ParamGatherer(
            model,
            units,
            sharded,
            replicas,
            int(z.stage3_prefetch_bucket_size),
            frozen=frozen,
        )
        # after the gatherer's hooks: an 8-bit linear that is a unit itself is gathered first
        gatherer.keep_hooks(track_8bit_codes(int8_linears))
    elif int8_linears:  # nothing sharded: the codes stay whole in weight.data
        track_8bit_codes(int8_linears)
    return ZeroPlan(per_group, gatherer, frozen)


def comm_bytes_theory(
    flat_groups: list[FlatGroup],
    stage: int,
    micro_steps: int = 1,
    comm_itemsize: int | None = None,
    gathers: int | None = None,
) -> int:
    """Model-state bytes one optimizer step records under ``stage`` (module docstring).

    Gradient reductions move ``comm_itemsize`` bytes per element (the
    ``communication_data_type``; default: the gradients' own), parameter gathers the
    model dtype's. ``gathers``: stage 3 under a pipeline, the times each of the rank's
    stages was all-gathered this step (``pipeline_gather``: at most once per run of the
    action list, once per step with one stage per rank); the gradients are then reduced
    once after the schedule, whatever ``micro_steps``."""
    if gathers is not None:
        return _pipelined_stage3_bytes(flat_groups, gathers, comm_itemsize)
    total = 0
    for g in flat_groups:
        grads = g.numel * (comm_itemsize or g.itemsize)
        params = g.numel * g.itemsize
        if stage == 0:
            total += 2 * grads  # one all-reduce at the boundary
        elif stage == 1:  # reduced once at the boundary, then the updated chunks gathered
            total += grads + params
        elif g.shard_params:  # gathered for forward and for backward, reduced: per micro-step
            total += (2 * params + grads) * micro_steps
        else:  # stage 2, and stage 3's persistent parameters
            total += grads * micro_steps + params
    return total


def _pipelined_stage3_bytes(flat_groups, gathers: int, comm_itemsize: int | None) -> int:
    """Stage 3 under a pipeline, every sharded unit gathered ``gathers`` times:
    ``gathers x Psi`` gathered and ``Psi`` reduce-scattered for the sharded groups;
    the persistent (whole) ones reduce-scatter once and gather after the step (stage 2's
    treatment, reduced once because the backward does not synchronise)."""
    total = 0
    for g in flat_groups:
        grads = g.numel * (comm_itemsize or g.itemsize)
        params = g.numel * g.itemsize
        total += (gathers * params + grads) if g.shard_params else (grads + params)
    return total
