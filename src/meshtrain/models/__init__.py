"""Reference models used by tests, benchmarks and examples."""

from meshtrain.models.decoder import (
    Block,
    Decoder,
    DecoderConfig,
    causal_lm_loss,
    count_parameters,
    flops_per_token,
)

__all__ = [
    "Block",
    "Decoder",
    "DecoderConfig",
    "causal_lm_loss",
    "count_parameters",
    "flops_per_token",
]
