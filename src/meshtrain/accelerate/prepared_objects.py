"""Everything one Accelerator has prepared, in ``prepare`` order: its models, optimizers,
dataloaders, LR schedulers, the objects registered for checkpointing, and the loader
being iterated. ``save_state`` / ``load_state`` walk these lists in that order, so a
resume must prepare the same objects in the same order."""

from __future__ import annotations

from typing import Any

from meshtrain.accelerate.prepared_loader import PreparedDataLoader
from meshtrain.accelerate.prepared_model import PreparedModel
from meshtrain.accelerate.prepared_optimizer import PreparedOptimizer
from meshtrain.accelerate.prepared_scheduler import PreparedScheduler


class PreparedObjects:
    def __init__(self) -> None:
        self.models: list[PreparedModel] = []
        self.optimizers: list[PreparedOptimizer] = []
        self.loaders: list[PreparedDataLoader] = []
        self.schedulers: list[PreparedScheduler] = []
        self.custom: list[Any] = []  # register_for_checkpointing
        # set by the loader at each batch and cleared at its end: accumulate() ends a
        # window at its last batch and gather_for_metrics drops its padding rows
        self.active_loader: PreparedDataLoader | None = None

    @property
    def engines(self) -> list:
        """The Engine of each trained model, in prepare order."""
        return [m.engine for m in self.models if m.engine is not None]

    def model_of(self, model: Any) -> PreparedModel | None:
        """The ``PreparedModel`` of ``model`` (itself, or the one wrapping that module)."""
        if isinstance(model, PreparedModel):
            return model
        return next((m for m in self.models if m.module is model), None)

    def optimizer_of(self, optimizer: Any) -> PreparedOptimizer | None:
        """The ``PreparedOptimizer`` wrapping ``optimizer``, if it was prepared."""
        return next((o for o in self.optimizers if o.optimizer is optimizer), None)

    def unlinked(self) -> list[tuple[PreparedModel, PreparedOptimizer]]:
        """Each prepared optimizer without an Engine yet, with the first prepared model
        owning all its parameters (an optimizer whose model is not prepared yet waits)."""
        pairs = []
        for opt in self.optimizers:
            if opt.model is not None:
                continue
            wanted = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
            model = next(
                (m for m in self.models if wanted <= {id(p) for p in m.module.parameters()}),
                None,
            )
            if model is not None:
                pairs.append((model, opt))
        return pairs

    def set_active_loader(self, loader: PreparedDataLoader) -> None:
        self.active_loader = loader

    def end_of_loader(self, loader: PreparedDataLoader) -> None:
        if self.active_loader is loader:
            self.active_loader = None

    def clear(self) -> None:
        """Drop every prepared object and the hooks and drivers on their modules."""
        for m in self.models:
            if m.driver is not None:
                m.driver.remove()
            for h in m.__dict__.pop("hooks", []):
                h.remove()
        self.models, self.optimizers, self.loaders = [], [], []
        self.schedulers, self.custom = [], []
        self.active_loader = None


__all__ = ["PreparedObjects"]
