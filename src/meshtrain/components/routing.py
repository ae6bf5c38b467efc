"""Top-k routing: which experts each token goes to, and with what weight. Dropless.

A router scores every token against every expert (``logits = x @ W_r^T``, ``[N, E]``) and
keeps ``k`` experts per token. The families differ in the order of the two operations and
in a final normalisation; each is reproduced here exactly (``ROUTINGS``)::

    softmax_topk   p = softmax(logits); (w, i) = topk(p, k)            Mixtral (then
                   w /= sum(w) when normalised), Qwen2-MoE / Qwen3-MoE (``norm_topk_prob``)
    topk_softmax   (l, i) = topk(logits, k); w = softmax(l)            the Mixtral paper /
                   (normalised by construction)                         Megatron's "pre-softmax"
    sigmoid_topk   s = sigmoid(logits); (_, i) = topk(s + b, k);        DeepSeek-V3
                   w = s[i], w /= sum(w) when normalised

Scores are computed in fp32 whatever the activations' dtype (the transformers routers do
the same), so bf16 training routes as fp32 would.

*Dropless*: there is no capacity factor; every token reaches all ``k`` of its experts,
however unbalanced the routing. Balance is steered instead, by the auxiliary loss
(:mod:`meshtrain.parallel.experts.aux_loss`) or by the auxiliary-loss-free expert bias ``b``
(DeepSeek-V3, :func:`update_expert_bias`): ``b`` shifts which experts are *selected* and
never the weights of the selected ones.
"""

from __future__ import annotations

import torch

from meshtrain.errors import ConfigError

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")


def check_routing(routing: str, num_experts: int, top_k: int, field: str = "model.moe") -> None:
    """ConfigError naming ``field`` for a routing that cannot run."""
    if routing not in ROUTINGS:
        raise ConfigError(
            f"{field}.routing: {routing!r} is not a routing meshtrain builds; use one of "
            f"{', '.join(ROUTINGS)}"
        )
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ConfigError(
            f"{field}.top_k: {top_k} with {num_experts} experts; top_k must be between 1 "
            "and the number of experts"
        )


def route(
    logits: torch.Tensor,
    top_k: int,
    routing: str = "softmax_topk",
    normalize: bool = True,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] fp32, experts [N, k] int64)`` for router ``logits`` ``[N, E]``.

    ``bias`` (``[E]``, optional) is added to the scores only to *choose* the experts (the
    auxiliary-loss-free balance); the weights are the unbiased scores of those experts.
    """
    scores = logits.float()
    if routing == "topk_softmax":
        _, experts = torch.topk(scores if bias is None else scores + bias, top_k, dim=-1)
        return torch.softmax(scores.gather(-1, experts), dim=-1), experts
    if routing == "softmax_topk":
        scores = torch.softmax(scores, dim=-1)
    elif routing == "sigmoid_topk":
        scores = torch.sigmoid(scores)
    else:
        check_routing(routing, logits.shape[-1], top_k)
    if bias is None:
        weights, experts = torch.topk(scores, top_k, dim=-1)
    else:
        _, experts = torch.topk(scores + bias, top_k, dim=-1)
        weights = scores.gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balance: ``b_e += rate * sign(mean(c) - c_e)``.

    ``tokens_per_expert`` (``[E]``) must count the tokens of *every* replica (all-reduced
    over dp x cp by the caller) so that every rank applies the same update and the biases
    stay identical without a broadcast.
    """
    c = tokens_per_expert.float()
    bias.add_(rate * torch.sign(c.mean() - c))


__all__ = ["ROUTINGS", "check_routing", "route", "update_expert_bias"]
