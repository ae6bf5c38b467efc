"""Tiny transformers models with random weights, for tests (no download).

One definition so every test that needs "a small Llama" builds the same one; pass
overrides for what a test is about (e.g. ``tie_word_embeddings=True``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)


def tiny_llama_config(**overrides: Any):
    """A ``transformers.LlamaConfig`` of ~20k parameters (``LLAMA_DEFAULTS`` + overrides)."""
    import transformers

    cfg = transformers.LlamaConfig(**{**LLAMA_DEFAULTS, **overrides})
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def tiny_llama(seed: int = 0, **overrides: Any):
    """A ``LlamaForCausalLM`` from ``tiny_llama_config(**overrides)``, seeded weights."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(**overrides))


class Block(nn.Module):
    """A residual tanh block: ``x + tanh(fc(x))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def head(embed: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The tied output head: logits from the input embedding's weight."""
    return x @ embed.weight.T


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tiny_pipe_layers(blocks: int = 4, vocab: int = 32, dim: int = 16) -> tuple[list, Any]:
    """``(layers, loss_fn)`` for ``meshtrain.pipe.PipelineModule``: a tied input embedding
    / output head (``TiedLayerSpec("embed")``), ``blocks`` residual tanh blocks, a
    LayerNorm; batches are ``(input_ids, labels)``."""
    from meshtrain.pipe import LayerSpec, TiedLayerSpec

    layers = [
        TiedLayerSpec("embed", nn.Embedding, vocab, dim),
        *[LayerSpec(Block, dim) for _ in range(blocks)],
        LayerSpec(nn.LayerNorm, dim),
        TiedLayerSpec("embed", nn.Embedding, vocab, dim, forward_fn=head),
    ]
    return layers, lm_loss


class LinearChain(nn.Module):
    """Four linears with no block list, ``forward(x, labels)`` returning the loss (seed
    003's shape): a pipeline cuts its traced forward; ``LINEAR_CHAIN_PLAN`` is its tp plan."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16)
        self.fc3, self.fc4 = nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, labels):
        h = self.fc2(torch.tanh(self.fc1(x)))
        return nn.functional.cross_entropy(self.fc4(torch.tanh(self.fc3(h))), labels)


LINEAR_CHAIN_PLAN = {"rows": [["fc1", "column"], ["fc2", "row"], ["fc3", "column"], ["fc4", "row"]]}


def tiny_decoder(**overrides: Any):
    """meshtrain's reference ``Decoder``, 4 tied blocks of width 32 (+ overrides)."""
    from meshtrain.models import Decoder, DecoderConfig

    defaults = dict(
        vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_dim=48, max_seq_len=16,
        tie_embeddings=True,
    )  # fmt: skip
    return Decoder(DecoderConfig(**{**defaults, **overrides}))


GPT2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=250, n_positions=32, n_embd=48, n_layer=2, n_head=6, attn_implementation="eager"
)


def tiny_gpt2_config(dropout: float = 0.0, **overrides: Any):
    """A ``transformers.GPT2Config`` (``GPT2_DEFAULTS`` + overrides); ``dropout`` sets the
    residual, embedding and attention dropout alike."""
    import transformers

    drops = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2Config(**{**GPT2_DEFAULTS, **drops, **overrides})


def tiny_gpt2(seed: int = 0, dropout: float = 0.0, **overrides: Any):
    """A ``GPT2LMHeadModel`` (tied LM head, fused q|k|v ``Conv1D``), seeded weights."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(tiny_gpt2_config(dropout, **overrides))


BERT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=250,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=80,
    max_position_embeddings=32,
    num_labels=3,
    attn_implementation="eager",
)


def tiny_bert(
    head: str = "ForSequenceClassification", seed: int = 0, dropout: float = 0.0, **overrides: Any
):
    """A ``transformers.Bert<head>`` (``"ForMaskedLM"``, ``"ForSequenceClassification"``,
    ``"ForTokenClassification"``, ``"Model"``), seeded weights; ``dropout`` sets the hidden
    and attention dropout alike."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, f"Bert{head}")(tiny_bert_config(dropout, **overrides))


def tiny_bert_config(dropout: float = 0.0, **overrides: Any):
    """A ``transformers.BertConfig`` (``BERT_DEFAULTS`` + overrides); ``dropout`` sets the
    hidden and attention dropout alike."""
    import transformers

    drops = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return transformers.BertConfig(**{**BERT_DEFAULTS, **drops, **overrides})
