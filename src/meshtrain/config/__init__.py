"""meshtrain's config: DeepSpeed's JSON keys, validated once into pydantic models.

Public API::

    load_config(source, *, world_size=None) -> Config   # dict | JSON/YAML path | Config
    Config.to_dict() -> dict                             # round-trips through load_config
    Config.precision -> "fp32" | "bf16" | "fp16"
    Config.resolve_auto({"optimizer.params.lr": 1e-3, ...}) -> Config
    Config.resolve_auto_defaults(hidden_size=None) -> Config
    Config.resolve_batch_sizes(dp_size) -> Config
    config_reference_markdown() -> str                   # the text of docs/config.md

Layout (a package because the documented models alone exceed one 400-line module):
``_types`` (strict number/bool types, the Section base), ``sections`` and ``optimizer``
(one model per section), ``model`` (Config and its resolution methods), ``resolve``
(batch-size arithmetic, "auto" defaults), ``loading`` (files, env, ``load_config``),
``_errors`` (pydantic errors -> ConfigError naming the path, did-you-mean), ``reference``
(docs generation).
"""

from __future__ import annotations

from meshtrain.config._types import AUTO
from meshtrain.config.loading import detect_world_size, load_config, read_config_file
from meshtrain.config.optimizer import (
    OPTIMIZERS,
    SCHEDULERS,
    AdagradParams,
    AdamParams,
    OptimizerConfig,
    SchedulerConfig,
    SGDParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from meshtrain.config.resolve import AUTO_DEFAULTS, BATCH_KEYS, derive_batch_sizes
from meshtrain.config.root import Config
from meshtrain.config.sections import (
    ActivationCheckpointingConfig,
    AmpConfig,
    BF16Config,
    CheckpointConfig,
    CompileConfig,
    DistributedConfig,
    FP16Config,
    MeshConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    ZeroConfig,
)


def config_reference_markdown() -> str:
    """The config reference page (docs/config.md), generated from the field docstrings."""
    from meshtrain.config.reference import config_reference_markdown as generate

    return generate()


__all__ = [
    "AUTO",
    "AUTO_DEFAULTS",
    "BATCH_KEYS",
    "OPTIMIZERS",
    "SCHEDULERS",
    "ActivationCheckpointingConfig",
    "AdagradParams",
    "AdamParams",
    "AmpConfig",
    "BF16Config",
    "CheckpointConfig",
    "CompileConfig",
    "Config",
    "DistributedConfig",
    "FP16Config",
    "MeshConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SGDParams",
    "SchedulerConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "config_reference_markdown",
    "derive_batch_sizes",
    "detect_world_size",
    "load_config",
    "read_config_file",
]
