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

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.parallel.experts.routed import RoutedExperts
from meshtrain.parallel.experts.routing import update_expert_bias


class ExpertLoad:
    """The MoE layers of one model and the group their tokens are counted over."""

    def __init__(self, model: nn.Module, replicas: Group, sequence: Group | None = None) -> None:
        self.replicas = replicas
        self.sequence = sequence  # the tp group when its ranks route sequence shards
        self.layers: list[tuple[nn.Module | None, RoutedExperts]] = []
        parents = {
            id(m.experts): m
            for m in model.modules()
            if isinstance(getattr(m, "experts", None), RoutedExperts)
        }
        for m in model.modules():
            if isinstance(m, RoutedExperts):
                self.layers.append((parents.get(id(m)), m))

    @classmethod
    def find(
        cls, model: nn.Module, replicas: Group, sequence: Group | None = None
    ) -> ExpertLoad | None:
        """None for a model without routed experts."""
        load = cls(model, replicas, sequence)
        return load if load.layers else None

    def end_step(self, step_comm: dict[tuple[str, str], int]) -> dict[str, int]:
        """Tokens per expert (min, max over layers and experts) of the step's global batch
        and its all-to-all bytes; applies the bias updates. Every rank must call it."""
        counts = []
        for _, experts in self.layers:
            seen = experts.tokens_seen
            device = experts.gate_up_proj.device  # NCCL reduces device tensors only
            counts.append(
                torch.zeros(experts.num_experts, dtype=torch.long, device=device)
                if seen is None
                else seen
            )
            experts.tokens_seen = None
        total = torch.stack(counts)  # [layers, E]
        comm.all_reduce(total, self.replicas, label="control")
        if self.sequence is not None:
            comm.all_reduce(total, self.sequence, label="control")
        for (block, _), load in zip(self.layers, total, strict=True):
            bias = getattr(block, "expert_bias", None)
            rate = getattr(getattr(block, "cfg", None), "bias_update_rate", 0.0)
            if bias is not None and rate > 0:
                update_expert_bias(bias, load.to(bias.device), rate)
        return {
            "tokens_per_expert_min": int(total.min()),
            "tokens_per_expert_max": int(total.max()),
            "all_to_all_bytes": sum(n for (op, _), n in step_comm.items() if op == "all_to_all"),
        }


__all__ = ["ExpertLoad"]
