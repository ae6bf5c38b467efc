"""``EngineView``: the part of an Engine that checkpoint, weights-export and memory code
may read. Those modules (``checkpoint_save``, ``checkpoint_load``, ``checkpoint_layout``,
``slice_state``, ``expert_layout``, ``model_names``, ``pretrained_shards``, ``memory``)
take their engine as this view, so what a checkpoint depends on is listed in one place
and a new dependency is a visible change here; ``tests/test_architecture.py`` checks that
they read nothing else of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import nn

from meshtrain.checkpoint.async_save import AsyncSaver
from meshtrain.distributed.topology import Topology
from meshtrain.parallel.pipeline.runtime import PipelineRuntime
from meshtrain.parallel.zero.stage import ZeroStage


class EngineView(Protocol):
    config: Any  # the resolved EngineConfig (checkpoint format, precision, optimizer)
    module: nn.Module  # this rank's model: its stage under pp, its shards under tp
    optimizer: Any  # the optimizer over ZeRO's master chunks
    topology: Topology
    zero: ZeroStage  # where the parameters, masters and optimizer state live
    pipeline: PipelineRuntime | None  # the stages this rank runs (pp > 1)
    gas: int  # gradient_accumulation_steps
    zero_stage: int
    global_steps: int

    def state_dict(self) -> dict[str, Any]:
        """The engine's own JSON-able state (counters, scaler, scheduler, data position)."""

    def load_state_dict(self, state: dict[str, Any], *, load_lr_scheduler: bool = True) -> None:
        """Restore what ``state_dict`` returned."""

    def async_saver(self) -> AsyncSaver:
        """The background checkpoint writer."""

    def wait_for_checkpoint(self) -> Path | None:
        """Block until an asynchronous save is committed; raise its failure."""


__all__ = ["EngineView"]
