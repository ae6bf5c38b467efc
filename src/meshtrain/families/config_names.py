"""``ConfigNames``: where a family's config keeps the sizes the activation-memory estimate
reads (``estimate.activations.DecoderDims``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigNames:
    """Attribute names on the model's ``config``; ``kv_heads`` may be missing from a config
    (no grouped-query attention: as many key/value heads as query heads)."""

    hidden: str
    heads: str
    kv_heads: str
    ffn: str
    vocab: str
    layers: str

    def in_order(self) -> tuple[str, str, str, str, str, str]:
        """The names in ``DecoderDims``' field order."""
        return (self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab, self.layers)


TRANSFORMERS_NAMES = ConfigNames(
    hidden="hidden_size",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    ffn="intermediate_size",
    vocab="vocab_size",
    layers="num_hidden_layers",
)
"""The names transformers' Llama-style configs use (``LlamaConfig``, ``Qwen2Config``, ...)."""

__all__ = ["TRANSFORMERS_NAMES", "ConfigNames"]
