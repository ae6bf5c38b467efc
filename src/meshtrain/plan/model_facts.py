"""What the planner needs to know about a model, read from it once on the meta device:
sizes, parameter counts (dense and expert), the family, and the built model itself (the
layout checks and the pipeline split run on it; no weights are allocated).

``--model`` takes ``decoder:KEY=VALUE,...`` (meshtrain's reference decoder), ``hf:PATH``
(a transformers config.json or its folder) or ``PATH.json``: a transformers config
(it has ``model_type``) or a reference-decoder config (``dim``, ``n_layers``, ...).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from torch import nn

from meshtrain.errors import ConfigError

__all__ = ["ModelFacts", "load_model"]


def load_model(spec: str) -> nn.Module:
    """The ``--model`` argument built on the meta device (module docstring)."""
    from meshtrain.estimate.cli import model_from_spec

    if spec.startswith(("decoder:", "hf:")):
        return model_from_spec(spec)
    if not os.path.exists(spec):
        raise ConfigError(
            f"--model {spec}: no such file; give hf:PATH (a transformers config.json or its "
            "folder), decoder:KEY=VALUE,... or a config .json file"
        )
    if os.path.isdir(spec):
        return model_from_spec(f"hf:{spec}")
    try:
        with open(spec) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model {spec}: not a JSON model config ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model {spec}: not a model config (a JSON object is expected)")
    if "model_type" in data:
        return model_from_spec(f"hf:{spec}")
    import dataclasses

    from meshtrain.models import DecoderConfig

    known = {f.name for f in dataclasses.fields(DecoderConfig)}
    if "dim" in data and "n_layers" in data and set(data) <= known | {"moe"}:
        moe = data.pop("moe", None)
        parts = [f"{k}={v}" for k, v in data.items()]
        model = model_from_spec("decoder:" + ",".join(parts)) if moe is None else None
        if model is None:
            import torch

            from meshtrain.models import Decoder

            with torch.device("meta"):
                model = Decoder(DecoderConfig(**data, moe=moe))
        return model
    raise ConfigError(
        f"--model {spec}: not a model config: neither a transformers config (no "
        "'model_type') nor a reference decoder's (needs 'dim' and 'n_layers'); a training "
        "config goes to --config"
    )


@dataclass(frozen=True)
class ModelFacts:
    """A model's sizes and counts (``of``), with the meta-device model it came from."""

    model: nn.Module
    family: str  # "decoder" or transformers' model_type
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    params: int  # every parameter once (tied counted once)
    expert_params: int  # routed experts, all of them
    n_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    max_seq: int | None = None
    tied: bool = False
    largest: int = 0  # elements of the largest parameter (its initialisation's temporaries)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def active_params(self) -> float:
        """Parameters a token passes through: the dense ones and top_k of E experts."""
        if not self.moe:
            return float(self.params)
        return self.params - self.expert_params * (1 - self.top_k / self.n_experts)

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        """Read ``model`` (a Decoder or a transformers model, best on the meta device)."""
        from meshtrain.estimate.experts import split_expert_params

        cfg = getattr(model, "config", None)
        (dense, dense_frozen), (expert, expert_frozen) = split_expert_params(model)
        total = dense + dense_frozen + expert + expert_frozen
        largest = max((p.numel() for p in model.parameters()), default=0)
        if hasattr(cfg, "dim") and hasattr(cfg, "n_layers"):  # meshtrain's Decoder
            moe = cfg.moe
            return cls(
                model=model,
                family="decoder",
                layers=cfg.n_layers,
                hidden=cfg.dim,
                heads=cfg.n_heads,
                kv_heads=cfg.n_heads,
                ffn=cfg.ffn_dim,
                vocab=cfg.vocab_size,
                params=total,
                expert_params=expert + expert_frozen,
                n_experts=moe.n_experts if moe else 0,
                top_k=moe.top_k if moe else 0,
                expert_ffn=(moe.expert_ffn_dim or cfg.ffn_dim) if moe else 0,
                max_seq=cfg.max_seq_len,
                tied=cfg.tie_embeddings,
                largest=largest,
            )
        if cfg is None or not hasattr(cfg, "num_hidden_layers"):
            raise ConfigError(
                f"--model: {type(model).__name__} has no config the planner reads (a "
                "reference decoder or a transformers model with num_hidden_layers)"
            )
        g = lambda *names, default=0: next(  # noqa: E731 - the first name the config has
            (getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), default
        )
        heads = g("num_attention_heads", "n_head")
        n_experts = g("num_local_experts", "num_experts", "n_routed_experts") if expert else 0
        return cls(
            model=model,
            family=str(getattr(cfg, "model_type", type(model).__name__)),
            layers=g("num_hidden_layers", "n_layer"),
            hidden=g("hidden_size", "n_embd"),
            heads=heads,
            kv_heads=g("num_key_value_heads", default=heads),
            ffn=g("intermediate_size", "n_inner", default=4 * g("hidden_size", "n_embd")),
            vocab=g("vocab_size"),
            params=total,
            expert_params=expert + expert_frozen,
            n_experts=n_experts,
            top_k=g("num_experts_per_tok", "top_k") if expert else 0,
            expert_ffn=g("moe_intermediate_size", "intermediate_size") if expert else 0,
            max_seq=g("max_position_embeddings", default=None),
            tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            largest=largest,
        )
