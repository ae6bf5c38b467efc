"""transformers Llama and GPT-2 written as DeepSpeed-style layer specs, for
``meshtrain.pipe.PipelineModule`` (tiny: ``tests/tiny_models``'s configs).

A stage boundary carries one tensor (the hidden states), so each block recomputes what
its model would pass alongside: the positions ``0..t-1`` (and for Llama the rotary
``cos``/``sin`` from them). Attention is ``sdpa`` with no mask, which transformers runs
causal. ``llama_specs`` / ``gpt2_specs`` return ``(layers, loss_fn)``; batches are
``(input_ids, labels)``, the loss the next-token cross entropy over the full logits
(the PipelineModule's LM head stays replicated under tensor parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class LlamaBlock(nn.Module):
    """``LlamaDecoderLayer`` with its rotary embedding (the model's, recomputed here)."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        self.layer = LlamaDecoderLayer(config, index)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device)[None]
        out = self.layer(h, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out


class LlamaNorm(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


def llama_specs(config):
    from meshtrain.pipe import LayerSpec

    return [
        LayerSpec(nn.Embedding, config.vocab_size, config.hidden_size),
        *[LayerSpec(LlamaBlock, config, i) for i in range(config.num_hidden_layers)],
        LayerSpec(LlamaNorm, config),
        LayerSpec(nn.Linear, config.hidden_size, config.vocab_size, bias=False),
    ], next_token_loss


class GPT2Embeddings(nn.Module):
    """GPT-2's token and position embeddings (the token one is also the LM head)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)


def gpt2_embed(emb: GPT2Embeddings, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    return emb.wte(ids) + emb.wpe(pos)


def gpt2_head(emb: GPT2Embeddings, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.wte.weight.T


class GPT2Layer(nn.Module):
    """``GPT2Block`` on the hidden states alone."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        self.block = GPT2Block(config, layer_idx=index)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.block(h)
        return out[0] if isinstance(out, tuple) else out


def gpt2_specs(config):
    from meshtrain.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("wte", GPT2Embeddings, config, forward_fn=gpt2_embed),
        *[LayerSpec(GPT2Layer, config, i) for i in range(config.n_layer)],
        LayerSpec(nn.LayerNorm, config.n_embd, eps=config.layer_norm_epsilon),
        TiedLayerSpec("wte", GPT2Embeddings, config, forward_fn=gpt2_head),
    ], next_token_loss
