"""Expert load per optimizer step: tokens per expert for the step log, and DeepSeek-V3's
auxiliary-loss-free bias update.

At the end of each optimizer step (every rank, :meth:`ExpertLoad.end_step`): the tokens
each rank routed to each expert of each layer since the last step (all micro-batches) are
all-reduced over the replicas (dp x cp, the ranks that see different tokens: one
all-reduce of ``layers x E`` int64, recorded under ``control``; under tensor x sequence
parallelism a second one over tp, whose ranks route different shards of a replica's
tokens), so the numbers are the
whole global batch's and the same on every rank. The step log shows their minimum and
maximum over experts and layers, and the all-to-all bytes of the step (``all_to_all`` on
``ep``: ``comm``'s convention, see :mod:`.dispatch`).

A layer with an ``expert_bias`` buffer (``model.moe.bias_update_rate > 0``) then moves it by
``rate * sign(mean load - load_e)`` (:func:`.routing.update_expert_bias`); every rank
applies the same update from the same counts, so the biases stay identical replicas.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.components.routing import update_expert_bias
from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group, ReduceOp
from meshtrain.parallel.experts.routed import RoutedExperts


class ExpertLoad:
    """The MoE layers of one model and the group their tokens are counted over.

    ``stages``: the pp group when the model is cut into pipeline stages (each rank holds
    some layers): the minimum and maximum are then taken over every stage's layers (one
    all-reduce of 2 int64, ``control``) and the all-to-all bytes summed over the stages
    (one more int64), so the log reads as for the whole model: one rank of each stage.
    ``sequence``: the tp group when its ranks route sequence shards (sequence
    parallelism): the counts are summed over it too."""

    def __init__(
        self,
        model: nn.Module,
        replicas: Group,
        stages: Group | None = None,
        sequence: Group | None = None,
    ) -> None:
        self.replicas = replicas
        self.stages = stages if stages is not None and stages.size > 1 else None
        self.sequence = sequence
        self.layers: list[tuple[nn.Module | None, RoutedExperts]] = []
        parents = {
            id(m.experts): m
            for m in model.modules()
            if isinstance(getattr(m, "experts", None), RoutedExperts)
        }
        for m in model.modules():
            if isinstance(m, RoutedExperts):
                self.layers.append((parents.get(id(m)), m))
        self._device = _device(model)

    @classmethod
    def find(
        cls,
        model: nn.Module,
        replicas: Group,
        stages: Group | None = None,
        sequence: Group | None = None,
    ) -> ExpertLoad | None:
        """None for a model without routed experts. Under a pipeline (``stages``, the pp
        group) the answer is the whole model's (``model.has_routed_experts``, set by the
        pipeline split), so a stage without MoE layers still joins ``end_step``."""
        load = cls(model, replicas, stages, sequence)
        found = bool(load.layers)
        if load.stages is not None:
            found = bool(getattr(model, "has_routed_experts", found))
        return load if found else None

    @classmethod
    def on_mesh(cls, model: nn.Module, topology) -> ExpertLoad | None:
        """:meth:`find` with the groups of ``topology``: the replicas (dp x cp), the pp
        group, and the tp group when the model runs under sequence parallelism (its tp
        ranks route sequence shards)."""
        tp_info = getattr(model, "meshtrain_tp", None) or {}
        sequence = topology.tp_group if tp_info.get("sequence_parallel") else None
        return cls.find(model, topology.replica_group, topology.pp_group, sequence)

    def end_step(self, step_comm: dict[tuple[str, str], int]) -> dict[str, int]:
        """Tokens per expert (min, max over layers and experts) of the step's global batch
        and its all-to-all bytes; applies the bias updates. Every rank must call it."""
        counts = [torch.zeros(0, dtype=torch.long, device=self._device)]
        for _, experts in self.layers:
            seen = experts.tokens_seen
            device = experts.gate_up_proj.device  # NCCL reduces device tensors only
            counts.append(
                torch.zeros(experts.num_experts, dtype=torch.long, device=device)
                if seen is None
                else seen
            )
            experts.tokens_seen = None
        total = torch.cat(counts)  # [layers x E]; empty for a stage without MoE layers
        comm.all_reduce(total, self.replicas, label="control")
        if self.sequence is not None:
            comm.all_reduce(total, self.sequence, label="control")
        size = self.layers[0][1].num_experts if self.layers else 1
        for (block, _), load in zip(self.layers, total.view(-1, size), strict=True):
            bias = getattr(block, "expert_bias", None)
            rate = getattr(getattr(block, "cfg", None), "bias_update_rate", 0.0)
            if bias is not None and rate > 0:
                update_expert_bias(bias, load.to(bias.device), rate)
        big = torch.iinfo(torch.long).max
        lo = int(total.min()) if total.numel() else big
        hi = int(total.max()) if total.numel() else -big
        sent = sum(n for (op, _), n in step_comm.items() if op == "all_to_all")
        if self.stages is not None:
            both = torch.tensor([-lo, hi], dtype=torch.long, device=self._device)
            comm.all_reduce(both, self.stages, op=ReduceOp.MAX, label="control")
            sent_t = torch.tensor([sent], dtype=torch.long, device=self._device)
            comm.all_reduce(sent_t, self.stages, label="control")
            lo, hi, sent = -int(both[0]), int(both[1]), int(sent_t)
        return {
            "tokens_per_expert_min": lo,
            "tokens_per_expert_max": hi,
            "all_to_all_bytes": sent,
        }


def _device(model: nn.Module) -> torch.device:
    """Where the model's tensors live (NCCL reduces device tensors only)."""
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


__all__ = ["ExpertLoad"]
