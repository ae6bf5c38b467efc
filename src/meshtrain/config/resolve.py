"""Batch-size arithmetic and the documented defaults for unfilled "auto" values.

Batch sizes (DeepSpeed's rule): ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * dp`` where ``dp = world_size / (pp * tp)``. Any two of the
three determine the third; with only ``train_batch_size`` or only the micro batch,
gradient accumulation is 1; with nothing, micro batch 1 and accumulation 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from meshtrain.config._errors import did_you_mean, models_in
from meshtrain.config._types import AUTO
from meshtrain.config.optimizer import (
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    OptimizerConfig,
    SchedulerConfig,
)
from meshtrain.errors import ConfigError

if TYPE_CHECKING:
    from meshtrain.config.root import Config

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

AUTO_DEFAULTS: dict[str, str] = {
    "train_batch_size": "treated as not written, then derived by the batch-size rule",
    "train_micro_batch_size_per_gpu": "treated as not written, then derived (1 if nothing is given)",
    "gradient_accumulation_steps": "treated as not written, then derived (1 if nothing is given)",
    "gradient_clipping": "1.0 (the transformers TrainingArguments default max_grad_norm)",
    "fp16.enabled": "false",
    "bf16.enabled": "false",
    "amp.enabled": "false",
    "amp.opt_level": '"O1"',
    "optimizer.params.lr": "5e-5 (the TrainingArguments default learning_rate)",
    "optimizer.params.betas": "[0.9, 0.999]",
    "optimizer.params.eps": "1e-8 (Adagrad: 1e-10)",
    "optimizer.params.weight_decay": "0.0",
    "scheduler.params.warmup_min_lr": "0.0",
    "scheduler.params.warmup_max_lr": "null, i.e. the optimizer's lr",
    "scheduler.params.warmup_num_steps": "0 (the TrainingArguments default warmup_steps)",
    "scheduler.params.total_num_steps": "no default: an error until filled",
    "zero_optimization.reduce_bucket_size": "hidden_size**2 (5e8 without hidden_size)",
    "zero_optimization.stage3_prefetch_bucket_size": "int(0.9 * hidden_size**2) (5e7 without hidden_size)",
    "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size (1e5 without hidden_size)",
    "zero_optimization.stage3_max_live_parameters": "1e9",
    "zero_optimization.stage3_max_reuse_distance": "1e9",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "false",
}
"""What ``Config.resolve_auto_defaults`` puts in place of an "auto" nobody filled."""


def auto_default_values(config: Config, hidden_size: int | None) -> dict[str, Any]:
    """The values behind AUTO_DEFAULTS for this config (total_num_steps has none)."""
    lr = config.optimizer.params.lr if config.optimizer is not None else AUTO
    lr = 5e-5 if lr == AUTO else lr
    h = hidden_size
    adagrad = config.optimizer is not None and config.optimizer.type == "Adagrad"
    return {
        **{key: None for key in BATCH_KEYS},
        "gradient_clipping": 1.0,
        "fp16.enabled": False,
        "bf16.enabled": False,
        "amp.enabled": False,
        "amp.opt_level": "O1",
        "optimizer.params.lr": lr,
        "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-10 if adagrad else 1e-8,
        "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_max_lr": None,
        "scheduler.params.warmup_num_steps": 0,
        "zero_optimization.reduce_bucket_size": h * h if h else 500_000_000,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * h * h) if h else 50_000_000,
        "zero_optimization.stage3_param_persistence_threshold": 10 * h if h else 100_000,
        "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
        "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }


def derive_batch_sizes(
    dp: int,
    train_batch_size: int | None = None,
    train_micro_batch_size_per_gpu: int | None = None,
    gradient_accumulation_steps: int | None = None,
) -> tuple[int, int, int]:
    """(train_batch_size, micro batch, accumulation steps) for ``dp`` ranks; ConfigError if impossible."""
    tbs, mb, gas = train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
    if tbs is not None and mb is not None and gas is not None:
        if tbs != mb * gas * dp:
            raise ConfigError(
                f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mb} * "
                f"gradient_accumulation_steps {gas} * data-parallel size {dp} = {mb * gas * dp}; "
                "fix one of them or leave one out to have it derived"
            )
        return tbs, mb, gas
    if tbs is not None and mb is None and gas is None:
        if tbs % dp:
            raise ConfigError(
                f"train_batch_size {tbs} is not divisible by data-parallel size {dp}; "
                f"use a multiple of {dp} or give train_micro_batch_size_per_gpu"
            )
        return tbs, tbs // dp, 1
    if tbs is not None:
        name, known = (
            ("train_micro_batch_size_per_gpu", mb)
            if mb is not None
            else ("gradient_accumulation_steps", gas)
        )
        if tbs % (known * dp):
            raise ConfigError(
                f"train_batch_size {tbs} is not divisible by {name} {known} * data-parallel "
                f"size {dp} = {known * dp}; use a multiple of {known * dp}"
            )
        other = tbs // (known * dp)
        return (tbs, known, other) if mb is not None else (tbs, other, known)
    mb = 1 if mb is None else mb
    gas = 1 if gas is None else gas
    return mb * gas * dp, mb, gas


def check_path(root: type[BaseModel], path: str) -> None:
    """ConfigError unless ``path`` names a config key (optimizer/scheduler params: any type's)."""
    model: Any = root
    parts = path.split(".")
    for i, key in enumerate(parts):
        prefix = ".".join(parts[:i])
        if model in ("optimizer.params", "scheduler.params"):
            registry = OPTIMIZER_PARAMS if model == "optimizer.params" else SCHEDULER_PARAMS
            names = {n for m in registry.values() for n in m.model_fields}
        elif isinstance(model, type):
            names = set(model.model_fields)
        else:
            names = set()
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{where}: unknown key{did_you_mean(key, sorted(names))}")
        if model is OptimizerConfig and key == "params":
            model = "optimizer.params"
            continue
        if model is SchedulerConfig and key == "params":
            model = "scheduler.params"
            continue
        field = model.model_fields[key] if isinstance(model, type) else None
        inner = models_in(field.annotation) if field is not None else []
        model = inner[0] if inner else None
