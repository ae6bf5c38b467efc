"""meshtrain: distributed training for PyTorch on torch.distributed.

The public API is loaded lazily (PEP 562) so that ``import meshtrain`` does not pull in
torch's distributed stack, let alone transformers or fastapi, until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from meshtrain.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DistributedError,
    MeshtrainError,
    TopologyError,
    TrainingError,
)
from meshtrain.version import __version__

# public name -> "module:attribute"
_LAZY = {
    "initialize": "meshtrain.engine.initialize:initialize",
    "from_pretrained": "meshtrain.interop.from_pretrained:from_pretrained",
    "add_config_arguments": "meshtrain.engine.initialize:add_config_arguments",
    "Engine": "meshtrain.engine.engine:Engine",
    "parallelize": "meshtrain.parallel.compose:parallelize",
    "init_distributed": "meshtrain.distributed.env:init_distributed",
    "shutdown_distributed": "meshtrain.distributed.env:shutdown_distributed",
    "Topology": "meshtrain.distributed.topology:Topology",
    "Config": "meshtrain.config:Config",
    "load_config": "meshtrain.config:load_config",
    "notebook_launcher": "meshtrain.launch.function:notebook_launcher",
    "Trainer": "meshtrain.trainer.trainer:Trainer",
    "TrainingArguments": "meshtrain.trainer.arguments:TrainingArguments",
    "TrainerCallback": "meshtrain.trainer.callbacks:TrainerCallback",
    "EarlyStoppingCallback": "meshtrain.trainer.callbacks:EarlyStoppingCallback",
    "EvalPrediction": "meshtrain.trainer.state:EvalPrediction",
    "Accelerator": "meshtrain.accelerate.accelerator:Accelerator",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DistributedError",
    "MeshtrainError",
    "TopologyError",
    "TrainingError",
    "__version__",
    "initialize",
    "from_pretrained",
    "add_config_arguments",
    "Engine",
    "parallelize",
    "init_distributed",
    "shutdown_distributed",
    "Topology",
    "Config",
    "load_config",
    "notebook_launcher",
    "Accelerator",
    "zero",
    "Trainer",
    "TrainingArguments",
    "TrainerCallback",
    "EarlyStoppingCallback",
    "EvalPrediction",
]


_SUBMODULES = ("zero",)  # meshtrain.zero.Init / GatheredParameters, as deepspeed.zero


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"meshtrain.{name}")
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    module_name, attr = target.split(":")
    # not cached in globals(): no module state; import_module is a dict lookup once loaded
    return getattr(importlib.import_module(module_name), attr)


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover
    from meshtrain.accelerate.accelerator import Accelerator
    from meshtrain.config import Config, load_config
    from meshtrain.distributed.env import init_distributed, shutdown_distributed
    from meshtrain.distributed.topology import Topology
    from meshtrain.engine.engine import Engine
    from meshtrain.engine.initialize import add_config_arguments, initialize
    from meshtrain.launch.function import notebook_launcher
    from meshtrain.parallel.compose import parallelize
    from meshtrain.trainer.arguments import TrainingArguments
    from meshtrain.trainer.callbacks import EarlyStoppingCallback, TrainerCallback
    from meshtrain.trainer.state import EvalPrediction
    from meshtrain.trainer.trainer import Trainer
