"""The reference decoder: a small Llama-style language model for tests, benchmarks, examples.

Token embedding -> n x [RMSNorm -> causal self-attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head. The blocks live in
``model.layers`` (an ``nn.ModuleList``) so ZeRO-3 can gather them one at a time, activation
checkpointing can wrap them and a pipeline can split them.

Initialisation is deterministic from ``DecoderConfig.seed`` through a private generator:
building the model never touches (or depends on) the global RNG, so every rank and the
single-process reference get bit-identical weights.

``forward(input_ids, labels=None)`` returns logits ``[batch, seq, vocab]``, or the mean
next-token cross-entropy (labels shifted inside; -100 is ignored) when labels are given.
As in transformers, ``shift_labels`` (already aligned with the logits: the label of
position t is the token at t+1) replaces ``labels`` and is not shifted again, and
``num_items_in_batch`` makes the loss a sum over valid tokens divided by that count
(context parallelism shifts the whole rows before cutting them, so the token at a chunk
border still has its label).

Mixture of experts: with ``DecoderConfig.moe`` (a :class:`~meshtrain.models.moe.MoEConfig`
or its dict) every block's MLP is a DeepSeek-style MoE layer (``meshtrain.models.moe``),
and the loss adds ``router_aux_loss_coef`` x the router's load-balancing loss over every
layer's router logits (``parallel.experts.aux_loss``; over all replicas' tokens once
``parallelize`` sets ``aux_group``).

Packed rows (padding-free): ``position_ids`` ``[batch, seq]`` that restart at 0 for each
document give each token its rotary position, and the attention of a token stays inside its
own document (``document_ids``, derived from the restarts unless given; see
``meshtrain.components.attention``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.components.attention import causal_attention
from meshtrain.components.documents import documents_from_positions
from meshtrain.models.moe import MoE, MoEConfig


@dataclass
class DecoderConfig:
    """Sizes of the reference decoder."""

    vocab_size: int = 1024
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 688  # SwiGLU hidden size (~8/3 x dim)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    seed: int = 1234
    moe: MoEConfig | None = None  # mixture-of-experts blocks (a dict is accepted)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head size {self.dim // self.n_heads} must be even for rotary")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the parameter dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rotary_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [T, hd/2]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) by position-dependent angles. x: [B, H, T, hd]."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.context = None  # context parallelism sets how attention spans the cp ranks

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # [B, T, D] -> [B, H, T, hd]; the head count is taken from the weight so that a
        # tensor-parallel split (fewer heads per rank) needs no change here.
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = causal_attention(q, k, v, document_ids=document_ids, context=self.context)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg.dim, cfg.ffn_dim, cfg.moe) if cfg.moe else MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, document_ids)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Llama-style decoder; see the module docstring."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        # nn.Linear/nn.Embedding draw their default init from the global RNG; fork it so
        # building a model never shifts the user's random stream (reset_parameters below
        # sets the real weights from the config's seed).
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The loss of (logits, labels); tensor parallelism swaps in the vocab-parallel one
        # because its logits hold only this rank's slice of the vocabulary.
        self.loss_fn = causal_lm_loss
        self.aux_group = None  # MoE: the replicas the load-balancing loss is reduced over
        # MoE: False on a pipeline stage's copy, where the stages add the loss over every
        # layer themselves (``parallel.pipeline.router_aux``)
        self.aux_in_forward = True
        self.aux_sequence_group = None  # and the tp group, under sequence parallelism
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from ``config.seed``: N(0, 0.02), output projections scaled
        by 1/sqrt(2 n_layers) (GPT-2), norms at 1. Uses a private generator.

        Built under ``meshtrain.zero.Init`` the children's parameters are already
        partitioned here; ``GatheredParameters`` makes each one whole while it is set (a
        no-op otherwise), so both builds get the same values."""
        from meshtrain.deepspeed_zero import GatheredParameters

        gen = torch.Generator().manual_seed(self.config.seed)
        out_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            with GatheredParameters(p, modifier_rank=0):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                out = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
                std = out_std if name.endswith(out) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.embed(input_ids)
        if position_ids is None:
            if t > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}"
                )
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        else:
            if int(position_ids.max()) >= self.config.max_seq_len:
                raise ValueError(
                    f"position_ids reach {int(position_ids.max())}, beyond max_seq_len "
                    f"{self.config.max_seq_len}; raise max_seq_len or pack shorter documents"
                )
            # [B, T, hd/2] -> [B, 1, T, hd/2]: one rotation per token, shared by the heads
            cos, sin = self.rope_cos[position_ids][:, None], self.rope_sin[position_ids][:, None]
            if document_ids is None:
                document_ids = documents_from_positions(position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, document_ids)
        logits = self.lm_head(self.norm(x))
        if labels is None and shift_labels is None:
            return logits
        if shift_labels is None and num_items_in_batch is None:
            loss = self.loss_fn(logits, labels)
        else:
            loss = self.loss_fn(
                logits, labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch
            )
        moe = self.config.moe
        if moe is not None and moe.router_aux_loss_coef and self.aux_in_forward:
            from meshtrain.parallel.experts.aux_loss import load_balancing_loss

            routers = tuple(layer.mlp.router_logits for layer in self.layers)
            aux = load_balancing_loss(
                routers,
                moe.n_experts,
                moe.top_k,
                None,
                self.aux_group,
                moe.routing,
                sequence=self.aux_sequence_group,
            )
            loss = loss + moe.router_aux_loss_coef * aux
        return loss


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from position t; -100 labels are ignored.

    ``shift_labels``: targets already aligned with ``logits`` (no shift here). With
    ``num_items_in_batch`` the loss is the sum over valid targets divided by it."""
    if shift_labels is None:
        logits, shift_labels = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        shift_labels.reshape(-1),
        ignore_index=-100,
        reduction="mean" if num_items_in_batch is None else "sum",
    )
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Distinct parameters (tied weights counted once)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        if not trainable_only or p.requires_grad:
            seen[id(p)] = p.numel()
    return sum(seen.values())


def flops_per_token(cfg: DecoderConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token (PaLM appendix B / Chinchilla convention, used for MFU).

    A matmul with N weights costs 2N FLOPs per token forward and 4N backward, so a
    training step costs ``6 N`` per token with N the non-embedding matmul weights
    (``lm_head`` included, the embedding lookup excluded), plus causal-attention score and
    value products: ``12 * n_layers * dim * seq_len`` per token for training (forward
    ``2 * 2 * T * d`` per layer, times 3 for backward). Inference is one third of that.
    """
    per_layer = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    if cfg.moe is not None:  # only the routed top-k and the shared experts run per token
        m = cfg.moe
        ffn = m.expert_ffn_dim or cfg.ffn_dim
        per_layer = 4 * cfg.dim * cfg.dim + cfg.dim * (3 * ffn * (m.top_k + m.n_shared_experts))
        per_layer += cfg.dim * m.n_experts  # the router
    n_matmul = cfg.n_layers * per_layer + cfg.dim * cfg.vocab_size
    train = 6 * n_matmul + 12 * cfg.n_layers * cfg.dim * seq_len
    return float(train if training else train / 3)
