"""``RoutedExperts``: one MoE layer's routed experts, whole (ep 1) or this ep rank's slice.

Weights in transformers' fused layout, so a state dict keeps its keys under ep::

    gate_up_proj  [L, 2F, H]   experts first_expert .. first_expert + L - 1
    down_proj     [L, H, F]

``L = E / ep`` local experts of ``E``; bytes per rank ``3 L F H b`` instead of ``3 E F H b``.
Both parameters carry ``meshtrain_expert = True`` once sharded (``is_expert_param``): they
are data-parallel only over ``edp``, the ranks that hold the same experts.

``forward(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`` is the
call signature of transformers' ``MixtralExperts`` / ``Qwen2MoeExperts`` /
``Qwen3MoeExperts``, so the family's own sparse-MoE block (its router, jitter, shared
expert) runs unchanged around it. Dispatch and combine: :mod:`.dispatch`; the expert
SwiGLU: :mod:`.gemm` (chosen once, at the first forward).

``last_counts`` (``[E]``, int64) keeps the tokens this rank routed to each expert in the
latest forward and ``tokens_seen`` their sum since the step log last read it
(:mod:`.load`); a forward recomputed inside backward (activation checkpointing) is not
counted twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtrain.distributed.comm import Group
from meshtrain.parallel.experts import gemm
from meshtrain.parallel.experts.dispatch import combine, dispatch, plan_dispatch


class RoutedExperts(nn.Module):
    """Experts ``[first_expert, first_expert + L)`` of ``num_experts`` (see module docstring)."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        act_fn: Callable,
        num_experts: int,
        group: Group | None = None,
        first_expert: int = 0,
        gemm_impl: str | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.group = group
        self.gemm = gemm_impl  # None: chosen at the first forward
        self.last_counts: torch.Tensor | None = None
        self.tokens_seen: torch.Tensor | None = None

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return f"experts {self.first_expert}..{last} of {self.num_experts}, gemm={self.gemm}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.gemm is None:
            self.gemm = gemm.choose(self.gate_up_proj, self.down_proj, self.act_fn)
        plan = plan_dispatch(top_k_index, self.num_experts, self.group)
        self.last_counts = plan.counts.detach()
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            seen = self.tokens_seen
            self.tokens_seen = self.last_counts if seen is None else seen + self.last_counts
        rows = dispatch(hidden_states, plan, self.group)
        y = gemm.SWIGLU[self.gemm](
            rows, self.gate_up_proj, self.down_proj, plan.local_counts, self.act_fn
        )
        return combine(
            y, top_k_weights, plan, self.group, hidden_states.shape[0], hidden_states.dtype
        )


__all__ = ["RoutedExperts"]
