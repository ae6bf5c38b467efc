"""The ``optimizer`` and ``scheduler`` sections: type names and per-type ``params`` models.

``type`` is matched case-insensitively and stored canonically; ``params`` is validated by
the model of that type, so a key of another optimizer is an unknown key with a suggestion.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ValidationError, model_validator

from meshtrain.config._errors import show, translate
from meshtrain.config._types import (
    Auto,
    Beta,
    Bool,
    NonNegFloat,
    NonNegInt,
    PosInt,
    Section,
    UnitFloat,
    canonical_choice,
)
from meshtrain.errors import ConfigError

OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Adafactor", "AdamW8bit", "Lion", "Lion8bit")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class AdamParams(Section):
    """``optimizer.params`` for Adam and AdamW."""

    lr: NonNegFloat | Auto = 1e-3
    """Learning rate (peak value when a scheduler is set)."""
    betas: tuple[Beta, Beta] | Auto = (0.9, 0.999)
    """Decay rates [beta1, beta2] of the first and second moment estimates."""
    eps: NonNegFloat | Auto = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: NonNegFloat | Auto = 0.0
    """Weight decay coefficient (decoupled, i.e. AdamW-style, when adam_w_mode is true)."""
    amsgrad: Bool = False
    """Use the AMSGrad variant (running maximum of the second moment)."""
    adam_w_mode: Bool = True
    """Decoupled weight decay (AdamW). DeepSpeed's "Adam" defaults to true, so "Adam" behaves as AdamW unless this is false; type "AdamW" is always decoupled."""
    bias_correction: Literal[True] = True
    """Must be true: meshtrain's Adam always applies bias correction."""
    torch_adam: Bool = False
    """Accepted and ignored: meshtrain always uses torch.optim's implementation."""
    fused: Bool | None = None
    """meshtrain: torch's fused kernel. Default: fused on CUDA, foreach elsewhere (bit-identical to torch's default AdamW). true on CPU is about 3x faster per step but differs from foreach by about 1 ulp per step (docs/performance.md)."""
    foreach: Bool | None = None
    """meshtrain: torch's multi-tensor (foreach) implementation. Default: foreach on accelerators other than CUDA, the single-tensor loop on CPU (same results, smaller temporaries)."""


class SGDParams(Section):
    """``optimizer.params`` for SGD."""

    lr: NonNegFloat | Auto = 1e-3
    """Learning rate."""
    momentum: NonNegFloat = 0.0
    """Momentum factor; 0 is plain SGD."""
    dampening: NonNegFloat = 0.0
    """Dampening for momentum (must be 0 with nesterov)."""
    weight_decay: NonNegFloat | Auto = 0.0
    """L2 penalty coefficient (added to the gradient)."""
    nesterov: Bool = False
    """Nesterov momentum (needs momentum > 0 and dampening 0)."""


class AdagradParams(Section):
    """``optimizer.params`` for Adagrad."""

    lr: NonNegFloat | Auto = 1e-2
    """Learning rate."""
    lr_decay: NonNegFloat = 0.0
    """Learning-rate decay per step."""
    weight_decay: NonNegFloat | Auto = 0.0
    """L2 penalty coefficient (added to the gradient)."""
    initial_accumulator_value: NonNegFloat = 0.0
    """Starting value of the sum of squared gradients."""
    eps: NonNegFloat | Auto = 1e-10
    """Added to the denominator for numerical stability."""


class AdafactorParams(Section):
    """``optimizer.params`` for Adafactor (torch.optim.Adafactor)."""

    lr: NonNegFloat | Auto = 1e-2
    """Learning rate (the maximum step size; torch's relative step min(lr, 1/sqrt(t)))."""
    beta2_decay: float = -0.8
    """Exponent of the second-moment decay schedule, beta2_t = 1 - t**beta2_decay."""
    eps: tuple[NonNegFloat, NonNegFloat] | None = None
    """[eps1, eps2]: eps1 guards the denominator, eps2 the parameter RMS. null: torch's default (eps1 = the dtype's smallest normal, eps2 = 1e-3)."""
    d: NonNegFloat = 1.0
    """Clipping threshold of the update's RMS."""
    weight_decay: NonNegFloat | Auto = 0.0
    """Decoupled weight decay coefficient."""
    maximize: Bool = False
    """Maximise the objective instead of minimising it."""


class AdamW8bitParams(Section):
    """``optimizer.params`` for AdamW8bit (bitsandbytes.optim.AdamW8bit)."""

    lr: NonNegFloat | Auto = 1e-3
    """Learning rate."""
    betas: tuple[Beta, Beta] | Auto = (0.9, 0.999)
    """Decay rates [beta1, beta2] of the first and second moments."""
    eps: NonNegFloat | Auto = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: NonNegFloat | Auto = 1e-2
    """Decoupled weight decay (bitsandbytes' default 0.01)."""
    min_8bit_size: NonNegInt = 4096
    """Parameters with fewer elements keep 32-bit state (judged on the whole parameter, also when ZeRO shards it)."""


class LionParams(Section):
    """``optimizer.params`` for Lion (bitsandbytes.optim.Lion32bit)."""

    lr: NonNegFloat | Auto = 1e-4
    """Learning rate."""
    betas: tuple[Beta, Beta] | Auto = (0.9, 0.99)
    """[beta1, beta2]: interpolation for the update sign, and momentum decay."""
    weight_decay: NonNegFloat | Auto = 0.0
    """Decoupled weight decay coefficient."""


class Lion8bitParams(LionParams):
    """``optimizer.params`` for Lion8bit (bitsandbytes.optim.Lion8bit)."""

    min_8bit_size: NonNegInt = 4096
    """Parameters with fewer elements keep 32-bit state (judged on the whole parameter)."""


OPTIMIZER_PARAMS: dict[str, type[Section]] = {
    "Adafactor": AdafactorParams,
    "AdamW8bit": AdamW8bitParams,
    "Lion": LionParams,
    "Lion8bit": Lion8bitParams,
    "Adam": AdamParams,
    "AdamW": AdamParams,
    "SGD": SGDParams,
    "Adagrad": AdagradParams,
}


class WarmupLRParams(Section):
    """``scheduler.params`` for WarmupLR: warm up, then hold warmup_max_lr."""

    warmup_min_lr: NonNegFloat | list[NonNegFloat] | Auto = 0.0
    """Learning rate at step 0 (a list: one value per parameter group)."""
    warmup_max_lr: NonNegFloat | list[NonNegFloat] | Auto | None = None
    """Learning rate reached after warmup_num_steps (a list: one per parameter group); null = the optimizer's lr (DeepSpeed's class default is 0.001)."""
    warmup_num_steps: NonNegInt | Auto = 1000
    """Optimizer steps of warmup."""
    warmup_type: canonical_choice(("log", "linear")) = "log"
    """Warmup curve: "log" (DeepSpeed's default) or "linear"."""


class WarmupDecayLRParams(WarmupLRParams):
    """``scheduler.params`` for WarmupDecayLR: warm up, then decay linearly to 0."""

    total_num_steps: PosInt | Auto
    """Total optimizer steps of training; the learning rate reaches 0 there. Required."""


class WarmupCosineLRParams(Section):
    """``scheduler.params`` for WarmupCosineLR: ratios of the optimizer's lr, cosine decay."""

    total_num_steps: PosInt | Auto
    """Total optimizer steps of training (end of the cosine). Required."""
    warmup_min_ratio: UnitFloat = 0.0
    """Learning rate at step 0, as a fraction of the optimizer's lr."""
    warmup_num_steps: NonNegInt | Auto = 1000
    """Optimizer steps of warmup (from warmup_min_ratio to 1.0)."""
    cos_min_ratio: UnitFloat = 1e-4
    """Learning rate at total_num_steps, as a fraction of the optimizer's lr."""
    warmup_type: canonical_choice(("log", "linear")) = "log"
    """Warmup curve: "log" (DeepSpeed's default) or "linear"."""


SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}


def _typed_params(
    data: Any, section: str, registry: dict[str, type[Section]], kinds: tuple[str, ...]
) -> Any:
    """Canonicalise ``type`` and validate ``params`` with the model of that type."""
    if not isinstance(data, dict):
        return data  # pydantic reports "expected a mapping"
    supported = ", ".join(kinds)
    if "type" not in data:
        raise ConfigError(f"{section}.type: missing required key; use one of {supported}")
    raw = data["type"]
    kind = next((k for k in kinds if isinstance(raw, str) and k.lower() == raw.lower()), None)
    if kind is None:
        raise ConfigError(f"{section}.type: {show(raw)} is not supported; use one of {supported}")
    params = data.get("params") or {}
    if isinstance(params, BaseModel):
        params = params.model_dump(exclude_unset=True)
    if not isinstance(params, dict):
        raise ConfigError(f"{section}.params: {show(params)} is not allowed; expected a mapping")
    model = registry[kind]
    try:
        validated = model.model_validate(params)
    except ValidationError as exc:
        raise translate(exc, model, f"{section}.params", params) from None
    return {**data, "type": kind, "params": validated}


class OptimizerConfig(Section):
    """``optimizer``: which torch optimizer to build and its keyword arguments."""

    type: canonical_choice(OPTIMIZERS)
    """Optimizer name, matched case-insensitively: Adam, AdamW, SGD, Adagrad, Adafactor, AdamW8bit, Lion or Lion8bit (the last three need bitsandbytes; docs/optimizers.md)."""
    params: (
        AdamParams
        | SGDParams
        | AdagradParams
        | AdafactorParams
        | AdamW8bitParams
        | LionParams
        | Lion8bitParams
    )
    """Keyword arguments of the optimizer; the valid keys depend on type (see below). Absent: the type's defaults."""
    legacy_fusion: Bool = False
    """Accepted and ignored (DeepSpeed fused-kernel switch)."""

    @model_validator(mode="before")
    @classmethod
    def _params_of_type(cls, data: Any) -> Any:
        return _typed_params(data, "optimizer", OPTIMIZER_PARAMS, OPTIMIZERS)

    @model_validator(mode="after")
    def _coherent(self) -> OptimizerConfig:
        p = self.params
        if self.type == "AdamW" and isinstance(p, AdamParams) and not p.adam_w_mode:
            raise ConfigError(
                "optimizer.params.adam_w_mode: false contradicts type AdamW (always decoupled "
                'weight decay); remove adam_w_mode or use type "Adam"'
            )
        if isinstance(p, SGDParams) and p.nesterov and (p.momentum <= 0 or p.dampening != 0):
            raise ConfigError(
                f"optimizer.params.nesterov: true needs momentum > 0 and dampening 0 "
                f"(got momentum {p.momentum}, dampening {p.dampening})"
            )
        return self

    @property
    def decoupled_weight_decay(self) -> bool:
        """True when weight decay is AdamW-style (type AdamW, or Adam with adam_w_mode)."""
        return isinstance(self.params, AdamParams) and (
            self.type == "AdamW" or self.params.adam_w_mode
        )


class SchedulerConfig(Section):
    """``scheduler``: the learning-rate schedule, stepped once per optimizer step."""

    type: canonical_choice(SCHEDULERS)
    """Schedule name, matched case-insensitively: WarmupLR, WarmupDecayLR or WarmupCosineLR."""
    params: WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams
    """Arguments of the schedule; the valid keys depend on type (see below). Absent: the type's defaults."""

    @model_validator(mode="before")
    @classmethod
    def _params_of_type(cls, data: Any) -> Any:
        return _typed_params(data, "scheduler", SCHEDULER_PARAMS, SCHEDULERS)
