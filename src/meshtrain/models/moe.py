"""The reference decoder's mixture-of-experts layer (DeepSeek-style), used when
``DecoderConfig.moe`` is set: each block's SwiGLU MLP becomes::

    y = shared(x) + sum_{e in topk(x)} w_e(x) * expert_e(x)

* ``shared``: ``n_shared_experts`` always-on experts, fused into one SwiGLU of
  ``n_shared_experts x expert_ffn_dim`` (DeepSeek's layout; replicated like any weight);
* ``experts``: ``n_experts`` fine-grained routed experts of ``expert_ffn_dim`` each, in a
  :class:`~meshtrain.parallel.experts.routed.RoutedExperts` (transformers' fused layout),
  which ``parallelize`` shards over the ep group;
* ``router``: a bias-free linear to ``n_experts`` logits; top-k by ``routing``
  (:mod:`meshtrain.components.routing`), dropless. With ``bias_update_rate > 0`` the
  router has an ``expert_bias`` buffer for DeepSeek-V3's auxiliary-loss-free balance.

FLOPs per token: ``6 d F (top_k + n_shared)`` for the experts plus ``2 d E`` for the router,
not ``6 d F E``: only the chosen experts run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.components.routing import check_routing, route
from meshtrain.parallel.experts.routed import RoutedExperts


@dataclass
class MoEConfig:
    """``model.moe``: the mixture-of-experts layer of every block."""

    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0
    expert_ffn_dim: int = 0  # 0: the decoder's ffn_dim
    routing: str = "softmax_topk"  # or topk_softmax, sigmoid_topk (components.routing)
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0  # x the load-balancing loss, added to the LM loss
    bias_update_rate: float = 0.0  # > 0: auxiliary-loss-free balance (DeepSeek-V3)

    def __post_init__(self) -> None:
        check_routing(self.routing, self.n_experts, self.top_k)
        if self.n_shared_experts < 0 or self.expert_ffn_dim < 0:
            raise ValueError(
                f"model.moe: n_shared_experts {self.n_shared_experts} and expert_ffn_dim "
                f"{self.expert_ffn_dim} must be >= 0"
            )

    def to_dict(self) -> dict:
        return asdict(self)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with a given hidden size (the shared experts)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Shared + routed experts (see the module docstring). ``router_logits`` holds the
    latest forward's ``[tokens, n_experts]`` logits for the decoder's auxiliary loss."""

    def __init__(self, dim: int, ffn_dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.expert_ffn_dim or ffn_dim
        self.router = nn.Linear(dim, cfg.n_experts, bias=False)
        self.experts = RoutedExperts(
            torch.empty(cfg.n_experts, 2 * hidden, dim),
            torch.empty(cfg.n_experts, dim, hidden),
            F.silu,
            cfg.n_experts,
        )
        self.shared = SwiGLU(dim, cfg.n_shared_experts * hidden) if cfg.n_shared_experts else None
        if cfg.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        else:
            self.expert_bias = None
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.router(h)
        weights, experts = route(
            logits, self.cfg.top_k, self.cfg.routing, self.cfg.norm_topk_prob, self.expert_bias
        )
        y = self.experts(h, experts, weights)
        if self.shared is not None:
            y = y + self.shared(h)
        self.router_logits = logits
        return y.reshape(shape)


__all__ = ["MoE", "MoEConfig", "SwiGLU"]
