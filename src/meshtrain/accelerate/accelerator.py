"""``meshtrain.Accelerator``: accelerate's training-loop API on meshtrain's Engine.

A plain PyTorch loop moves to many processes with three changes (seed 003)::

    accelerator = Accelerator()                       # or config= a ZeRO / DeepSpeed config
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    for x, y in train_loader:
        with accelerator.accumulate(model):
            loss = F.nll_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()                          # acts when sync_gradients only
            optimizer.zero_grad()

``prepare`` takes any objects in any grouping and order across calls. Each model whose
optimizer is prepared (in the same call or another) gets its own Engine, built when both
are known, from a config: the one given (a meshtrain / DeepSpeed dict or path: ZeRO
stage, offload, mesh), with ``train_micro_batch_size_per_gpu`` filled from the training
loader's ``batch_size`` and ``fp16`` / ``bf16`` from ``mixed_precision``. Every Engine
of one Accelerator shares its Topology: one process group, one data-parallel mesh, each
engine reducing its own flat buffers over the same dp group (see docs/accelerate.md). A
model without an optimizer (evaluation, a frozen teacher) gets no Engine: it runs as it
is on the device, and if it does get gradients they are averaged over the ranks at
synchronising backwards, as DDP would.

Gradient accumulation is accelerate's: ``accumulate`` counts micro-steps and sets
``sync_gradients`` (every ``gradient_accumulation_steps``-th call, and at the last batch
of the prepared loader being iterated); ``backward`` divides the loss by the steps; what
``p.grad`` holds when is ``meshtrain.accelerate.grads``' contract.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from meshtrain.accelerate.engine_config import (
    config_dict,
    dataloader_options,
    engine_config,
    int_argument,
    refuse_unsupported,
)
from meshtrain.accelerate.grads import (
    EngineDriver,
    average_plain_grads,
    clip_grad_norm,
    clip_grad_value,
)
from meshtrain.accelerate.prepared import (
    PreparedDataLoader,
    PreparedModel,
    PreparedOptimizer,
    PreparedScheduler,
)
from meshtrain.accelerate.process_queries import ProcessQueries
from meshtrain.accelerate.state_io import StateIO
from meshtrain.errors import ConfigError


class Accelerator(ProcessQueries, StateIO):
    """accelerate's ``Accelerator`` on meshtrain Engines (see the module docstring).

    Args:
        mixed_precision: ``None`` / ``"no"`` (fp32), ``"fp16"`` (dynamic loss scaling) or
            ``"bf16"``.
        gradient_accumulation_steps: micro-batches per optimizer step.
        config: a meshtrain / DeepSpeed config (dict, JSON/YAML path or ``Config``): ZeRO
            stage, offload, mesh, clipping, ... Batch sizes are filled from the loader.
        seed: meshtrain's: a fixed seed for the shuffled loaders' generator. None (the
            default) is accelerate's: drawn from the global torch RNG at ``prepare``.
        dataloader_config: accelerate's ``DataLoaderConfiguration`` (or any object with
            its attributes): ``split_batches=True`` makes the loader's ``batch_size`` the
            global batch, split over the processes (it must divide by them); see
            ``engine_config.dataloader_options`` for the rest.
        split_batches: accepted and ignored, as accelerate 1.15 ignores it (a warning
            says so): pass ``dataloader_config`` instead.
        log_with: accelerate's trackers (``"tensorboard"``, ``"all"``, a tracker object or
            a list) plus meshtrain's ``"jsonl"``, written under ``project_dir``
            (``trackers.choice``).
        cpu, device_placement, step_scheduler_with_optimizer, project_dir: accelerate's
            arguments of those names; the others accelerate has are refused by name.
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        config=None,
        *,
        seed: int | None = None,
        dataloader_config: Any = None,
        split_batches: Any = None,
        cpu: bool = False,
        device_placement: bool = True,
        step_scheduler_with_optimizer: bool = True,
        project_dir: str | os.PathLike | None = None,
        log_with: Any = None,
        **accelerate_kwargs: Any,
    ) -> None:
        refuse_unsupported(accelerate_kwargs)
        gas = int_argument("gradient_accumulation_steps", gradient_accumulation_steps, 1)
        self._config = config_dict(config, mixed_precision, gas)
        self.mixed_precision = mixed_precision or "no"
        self.gradient_accumulation_steps = int(self._config["gradient_accumulation_steps"])
        self.seed = None if seed is None else int_argument("seed", seed, 0)
        self.dataloader_config = dataloader_config
        self.split_batches = dataloader_options(dataloader_config, split_batches)
        self.device_placement = bool(device_placement)
        self.step_scheduler_with_optimizer = bool(step_scheduler_with_optimizer)
        self.project_dir = None if project_dir is None else str(project_dir)
        self._env, self.topology = self._join(cpu)
        from meshtrain.accelerate.trackers.choice import Trackers

        self.log_with = log_with
        self._trackers = Trackers(log_with, self.project_dir, self.topology.rank == 0)
        self.step = 0  # micro-steps counted by accumulate() (accelerate's ``step``)
        self._sync = True
        self._local = 0  # depth of no_sync()
        self._models: list[PreparedModel] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._loaders: list[PreparedDataLoader] = []
        self._schedulers: list[PreparedScheduler] = []
        self._custom: list[Any] = []  # register_for_checkpointing
        self._active_loader: PreparedDataLoader | None = None

    def _join(self, cpu: bool):
        """Join the process group and build the mesh (the one set-up call)."""
        from meshtrain.distributed.env import read_env
        from meshtrain.engine.start import join_mesh

        topology = join_mesh(self._config)  # the one set-up path (engine/start.py)
        env = read_env()
        if cpu and topology.device.type != "cpu":
            raise ConfigError(
                f"Accelerator(cpu=True): this process runs on {topology.device}; meshtrain "
                "picks the device from the launcher's environment (hide the GPUs with "
                "CUDA_VISIBLE_DEVICES='' to train on CPU)"
            )
        return env, topology

    @property
    def engine(self):
        """The Engine of the (first) trained model; ``engines`` lists them all."""
        return self.engines[0] if self.engines else None

    @property
    def engines(self) -> list:
        return [m.engine for m in self._models if m.engine is not None]

    # prepare -----------------------------------------------------------------------------------
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
        self._link()
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, **_: Any):
        """The model as a ``PreparedModel`` (its Engine comes with its optimizer)."""
        if isinstance(model, PreparedModel):
            return model
        for m in self._models:
            if m.module is model:
                return m
        if self.device_placement if device_placement is None else device_placement:
            model.to(self.device)
        prepared = PreparedModel(self, model)
        # which backward reached this model (its gradients are averaged only then, as
        # DDP reduces in the model's own backward); the Engine's driver has its own
        prepared.__dict__["hooks"] = [
            p.register_post_accumulate_grad_hook(
                lambda _p, m=prepared: m.__dict__.update(touched=True)
            )
            for p in model.parameters()
            if p.requires_grad
        ]
        self._models.append(prepared)
        self._link()
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, **_: Any):
        """The optimizer as a ``PreparedOptimizer`` (linked to its model's Engine)."""
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        for o in self._optimizers:
            if o.optimizer is optimizer:
                return o
        prepared = PreparedOptimizer(self, optimizer)
        self._optimizers.append(prepared)
        self._link()
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        """The LR scheduler with accelerate's stepping (``PreparedScheduler``)."""
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        prepared = PreparedScheduler(self, scheduler, self.step_scheduler_with_optimizer)
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, loader: DataLoader, **_: Any) -> PreparedDataLoader:
        """The loader dealt over the data-parallel ranks in accelerate's order: whole
        consecutive batches, rank ``r`` taking batches ``r, r + R, ...``, the last global
        step padded with the pass's first rows; ``batch_size`` rows per rank
        (``batch_size / R`` with ``split_batches``); shuffled as accelerate shuffles when
        the original was; resumable (``prepared.prepared_loader``)."""
        from meshtrain.accelerate.prepared import prepared_loader

        if isinstance(loader, PreparedDataLoader):
            return loader
        device = self.device if self.device_placement else torch.device("cpu")
        prepared = prepared_loader(loader, self.topology, device, self.seed, self.split_batches)
        prepared.on_batch = self._set_active_loader
        prepared.on_end = self._end_of_loader
        self._loaders.append(prepared)
        return prepared

    def _set_active_loader(self, loader: PreparedDataLoader) -> None:
        self._active_loader = loader

    def _end_of_loader(self, loader: PreparedDataLoader) -> None:
        if self._active_loader is loader:
            self._active_loader = None

    def _link(self) -> None:
        """Build an Engine for each prepared model whose optimizer is prepared: the
        optimizer's parameters must all be the model's."""
        for opt in self._optimizers:
            if opt.model is not None:
                continue
            wanted = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
            for model in self._models:
                owned = {id(p) for p in model.module.parameters()}
                if not wanted <= owned:
                    continue
                if model.engine is not None:
                    raise ConfigError(
                        f"prepare: {model!r} already trains with another optimizer; one "
                        "optimizer per model (put several param groups in one optimizer)"
                    )
                self._build_engine(model, opt)
                break

    def _build_engine(self, model: PreparedModel, opt: PreparedOptimizer) -> None:
        from meshtrain.engine.start import start_engine

        if self._config.get("fp16", {}).get("enabled") and self.engines:
            raise ConfigError(
                "mixed_precision='fp16' with a second trained model: each engine keeps "
                "its own dynamic loss scale and one backward can carry only one; train "
                "several models in bf16 or fp32"
            )
        cfg = engine_config(self._config, self._loaders, self.topology)
        opt.record_names(model.module)  # before the engine re-points its groups
        # the one set-up path: resolves the config and warns about keys it ignores
        engine = start_engine(model.module, cfg, topology=self.topology, optimizer=opt.optimizer)
        for h in model.__dict__.pop("hooks", []):
            h.remove()
        model.__dict__["engine"] = engine
        model.__dict__["driver"] = EngineDriver(engine)
        opt.model = model

    # the step ----------------------------------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step ends an accumulation window: the optimizer steps."""
        return self._sync

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self._sync = bool(value)

    def _do_sync(self) -> None:
        """accelerate's counting: the prepared loader's last batch ends a window."""
        loader = self._active_loader
        if loader is not None and loader.end_of_dataloader:
            self.step = 0
            self._sync = True
        else:
            self.step += 1
            self._sync = self.step % self.gradient_accumulation_steps == 0

    @contextmanager
    def accumulate(self, *models: Any) -> Iterator[None]:
        """One micro-step of gradient accumulation: gradients stay local until the
        window's last micro-step (``sync_gradients``), then they are averaged."""
        self._do_sync()
        if self._sync:
            yield
        else:
            with self.no_sync():
                yield

    @contextmanager
    def no_sync(self, model: Any = None) -> Iterator[None]:
        """Backward passes inside keep their gradients local (ZeRO stages 2-3 reduce
        every backward anyway: their gradients are sharded, and the result is the same)."""
        self._local += 1
        try:
            yield
        finally:
            self._local -= 1

    @contextmanager
    def trigger_sync_in_backward(self, model: Any) -> Iterator[None]:
        """The backward inside synchronises even within ``no_sync`` / ``accumulate``."""
        local, self._local = self._local, 0
        try:
            yield
        finally:
            self._local = local

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss / gradient_accumulation_steps).backward()``, reduced over the
        data-parallel ranks when this backward synchronises (``grads``' contract)."""
        loss = loss / self.gradient_accumulation_steps
        sync = self._local == 0
        for m in self._models:
            m.__dict__["touched"] = False
        drivers = [m.driver for m in self._models if m.driver is not None]
        if not drivers:
            loss.backward(**kwargs)
            if sync:
                self._average_plain_grads()
            return
        # each engine's stage records its own loss scale; the first one's multiplies
        multiplier = [d.before_backward(sync) for d in drivers][0]
        (loss.float() * multiplier).backward(**kwargs)
        for d in drivers:
            d.after_backward(sync, loss)
        if sync:
            self._average_plain_grads()

    def _average_plain_grads(self) -> None:
        """Models without an engine that this backward reached: average over dp (DDP)."""
        average_plain_grads(self._models, *self._dp())

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0):
        """Clip the gradients of ``parameters`` in place to a global norm of ``max_norm``
        and return the norm before clipping. At a synchronising step the gradients are
        the averaged global ones (every shard under ZeRO); inside a window, the local
        ones, as in accelerate."""
        return clip_grad_norm(self._models, parameters, max_norm, norm_type, self._sync)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp the gradients of ``parameters`` to ``[-clip_value, clip_value]`` in place
        (ZeRO stage 0: the ``p.grad`` views; the sharded stages refuse)."""
        clip_grad_value(self._models, parameters, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """fp16: the gradients are unscaled by ``clip_grad_norm_``; nothing to do here."""

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow)."""
        return any(o.step_was_skipped for o in self._optimizers)

    @contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """``torch.autocast`` in the mixed-precision dtype (a no-op in fp32)."""
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.mixed_precision)
        ctx = nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)
        with ctx:
            yield


def _is_scheduler(o: Any) -> bool:
    return (
        not isinstance(o, nn.Module | torch.optim.Optimizer | DataLoader)
        and hasattr(o, "step")
        and hasattr(o, "optimizer")
    )


__all__ = ["Accelerator"]
