"""``Accelerator.prepare`` and its per-kind calls: wraps the user's models, optimizers,
dataloaders and LR schedulers (``prepared``), records them in the Accelerator's
``PreparedObjects``, and builds an Engine for each model once its optimizer is prepared
too, in the same call or another: the one set-up path (``engine.start``), on the
Accelerator's Topology, from its config with the training loader's batch size."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from meshtrain.accelerate.engine_config import engine_config
from meshtrain.accelerate.grads import EngineDriver
from meshtrain.accelerate.prepared_loader import PreparedDataLoader, prepared_loader
from meshtrain.accelerate.prepared_model import PreparedModel
from meshtrain.accelerate.prepared_objects import PreparedObjects
from meshtrain.accelerate.prepared_optimizer import PreparedOptimizer
from meshtrain.accelerate.prepared_scheduler import PreparedScheduler
from meshtrain.engine.start import start_engine
from meshtrain.errors import ConfigError


class Preparer:
    def __init__(self, accelerator: Any, prepared: PreparedObjects, config: dict) -> None:
        # the prepared wrappers ask the Accelerator for sync_gradients, no_sync, autocast
        self.accelerator = accelerator
        self.prepared = prepared
        self.config = config

    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers given in any order and
        grouping (across calls too); returns them in the same order (one object: itself).
        Anything else comes back unchanged, as in accelerate."""
        if device_placement is not None and len(device_placement) != len(objects):
            raise ConfigError(
                f"prepare(device_placement=...): {len(device_placement)} entries for "
                f"{len(objects)} objects; give one per object"
            )
        out: list[Any] = list(objects)
        for i, o in enumerate(objects):  # loaders first: their batch size feeds the engine
            if isinstance(o, DataLoader):
                out[i] = self.prepare_data_loader(o)
        for i, o in enumerate(objects):
            if isinstance(o, nn.Module):
                out[i] = self.prepare_model(o)
            elif isinstance(o, torch.optim.Optimizer):
                out[i] = self.prepare_optimizer(o)
        for i, o in enumerate(objects):
            if _is_scheduler(o):
                out[i] = self.prepare_scheduler(o)
        self.link()
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, **_: Any):
        """The model as a ``PreparedModel`` (its Engine comes with its optimizer)."""
        known = self.prepared.model_of(model)
        if known is not None:
            return known
        acc = self.accelerator
        if acc.device_placement if device_placement is None else device_placement:
            model.to(acc.device)
        prepared = PreparedModel(acc, model)
        # which backward reached this model (its gradients are averaged only then, as
        # DDP reduces in the model's own backward); the Engine's driver has its own
        prepared.__dict__["hooks"] = [
            p.register_post_accumulate_grad_hook(
                lambda _p, m=prepared: m.__dict__.update(touched=True)
            )
            for p in model.parameters()
            if p.requires_grad
        ]
        self.prepared.models.append(prepared)
        self.link()
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, **_: Any):
        """The optimizer as a ``PreparedOptimizer`` (linked to its model's Engine)."""
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        known = self.prepared.optimizer_of(optimizer)
        if known is not None:
            return known
        prepared = PreparedOptimizer(self.accelerator, optimizer)
        self.prepared.optimizers.append(prepared)
        self.link()
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        """The LR scheduler with accelerate's stepping (``PreparedScheduler``)."""
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        acc = self.accelerator
        prepared = PreparedScheduler(acc, scheduler, acc.step_scheduler_with_optimizer)
        self.prepared.schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, loader: DataLoader, **_: Any) -> PreparedDataLoader:
        """The loader dealt over the data-parallel ranks in accelerate's order: whole
        consecutive batches, rank ``r`` taking batches ``r, r + R, ...``, the last global
        step padded with the pass's first rows; ``batch_size`` rows per rank
        (``batch_size / R`` with ``split_batches``); shuffled as accelerate shuffles when
        the original was; resumable (``prepared.prepared_loader``)."""
        if isinstance(loader, PreparedDataLoader):
            return loader
        acc = self.accelerator
        device = acc.device if acc.device_placement else torch.device("cpu")
        prepared = prepared_loader(loader, acc.topology, device, acc.seed, acc.split_batches)
        prepared.on_batch = self.prepared.set_active_loader
        prepared.on_end = self.prepared.end_of_loader
        self.prepared.loaders.append(prepared)
        return prepared

    def link(self) -> None:
        """Build an Engine for each prepared model whose optimizer is prepared: the
        optimizer's parameters must all be the model's."""
        for model, opt in self.prepared.unlinked():
            if model.engine is not None:
                raise ConfigError(
                    f"prepare: {model!r} already trains with another optimizer; one "
                    "optimizer per model (put several param groups in one optimizer)"
                )
            self.build_engine(model, opt)

    def build_engine(self, model: PreparedModel, opt: PreparedOptimizer) -> None:
        if self.config.get("fp16", {}).get("enabled") and self.prepared.engines:
            raise ConfigError(
                "mixed_precision='fp16' with a second trained model: each engine keeps "
                "its own dynamic loss scale and one backward can carry only one; train "
                "several models in bf16 or fp32"
            )
        topology = self.accelerator.topology
        cfg = engine_config(self.config, self.prepared.loaders, topology)
        opt.record_names(model.module)  # before the engine re-points its groups
        # the one set-up path: resolves the config and warns about keys it ignores
        engine = start_engine(model.module, cfg, topology=topology, optimizer=opt.optimizer)
        for h in model.__dict__.pop("hooks", []):
            h.remove()
        model.__dict__["engine"] = engine
        model.__dict__["driver"] = EngineDriver(engine)
        opt.model = model


def _is_scheduler(o: Any) -> bool:
    return (
        not isinstance(o, nn.Module | torch.optim.Optimizer | DataLoader)
        and hasattr(o, "step")
        and hasattr(o, "optimizer")
    )


__all__ = ["Preparer"]
