"""Tiny transformers models with random weights, for tests (no download).

One definition so every test that needs "a small Llama" builds the same one; pass
overrides for what a test is about (e.g. ``tie_word_embeddings=True``).
"""

from __future__ import annotations

from typing import Any

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
