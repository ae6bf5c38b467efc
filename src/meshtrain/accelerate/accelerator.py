"""``meshtrain.Accelerator``: accelerate's training-loop API on meshtrain's Engine.

A plain PyTorch loop moves to many processes with three changes (seed 003)::

    accelerator = Accelerator()                       # or config= a ZeRO / DeepSpeed config
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    for x, y in train_loader:
        with accelerator.accumulate(model):
            loss = F.nll_loss(model(x), y)
            accelerator.backward(loss)                # engine.backward
            optimizer.step()                          # engine.step (boundary only)
            optimizer.zero_grad()                     # no-op: the engine clears

``prepare`` builds one Engine from the model, its optimizer and a config: the one given
(a meshtrain / DeepSpeed dict or path: ZeRO stage, offload, mesh), with
``train_micro_batch_size_per_gpu`` filled from the training loader's ``batch_size``,
``gradient_accumulation_steps`` from the argument and ``fp16`` / ``bf16`` from
``mixed_precision`` (the model then runs in that dtype with fp32 master weights, as with
accelerate's DeepSpeed plugin). What each prepared object does is ``prepared``'s table.

Gradient accumulation: ``gradient_accumulation_steps = k`` makes the engine reduce and
step every ``k``-th ``optimizer.step()``, with the loss divided by ``k``. As in accelerate,
inside ``accumulate`` the last batch of a prepared dataloader ends the window
(``sync_gradients`` is True, the optimizer steps on the partial window's gradients, still
divided by ``k``), and the next epoch starts a fresh window.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from meshtrain.accelerate import collectives as col
from meshtrain.accelerate.engine_config import (
    config_dict,
    engine_config,
    int_argument,
    load_rng_state,
    rng_state,
    save_rng_state,
)
from meshtrain.accelerate.prepared import (
    PreparedDataLoader,
    PreparedModel,
    PreparedOptimizer,
    PreparedScheduler,
)
from meshtrain.errors import ConfigError


class Accelerator:
    """accelerate's ``Accelerator`` on one meshtrain Engine (see the module docstring).

    Args:
        mixed_precision: ``None`` / ``"no"`` (fp32), ``"fp16"`` (dynamic loss scaling) or
            ``"bf16"``.
        gradient_accumulation_steps: micro-batches per optimizer step.
        config: a meshtrain / DeepSpeed config (dict, JSON/YAML path or ``Config``): ZeRO
            stage, offload, mesh, clipping, ... Batch sizes are filled from the loader.
        seed: shuffle seed of the prepared training loaders (the same on every rank).
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        config=None,
        *,
        seed: int = 0,
    ) -> None:
        from meshtrain.distributed.env import read_env
        from meshtrain.engine.start import join_mesh

        gas = int_argument("gradient_accumulation_steps", gradient_accumulation_steps, 1)
        self._config = config_dict(config, mixed_precision, gas)
        self.mixed_precision = mixed_precision or "no"
        self.gradient_accumulation_steps = int(self._config["gradient_accumulation_steps"])
        self.seed = int_argument("seed", seed, 0)
        self.topology = join_mesh(self._config)  # the one set-up path (engine/start.py)
        self._env = read_env()
        self.engine = None
        self._optimizer: PreparedOptimizer | None = None
        self._loaders: list[PreparedDataLoader] = []
        self._schedulers: list[PreparedScheduler] = []
        self._active_loader: PreparedDataLoader | None = None
        self._sync_gradients: bool | None = None

    # where this process is ---------------------------------------------------------------------
    @property
    def process_index(self) -> int:
        return self.topology.rank

    @property
    def local_process_index(self) -> int:
        return self._env.local_rank

    @property
    def num_processes(self) -> int:
        return self.topology.world_size

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def distributed_type(self) -> str:
        return (
            "NO"
            if self.num_processes == 1
            else "MULTI_GPU"
            if self.device.type == "cuda"
            else "MULTI_CPU"
        )

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            torch.distributed.barrier()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (downloads, preprocessing), then the rest."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    # prepare -----------------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers given in any order;
        returns them in the same order (one object: that object)."""
        out: list[Any] = list(objects)
        loaders = [i for i, o in enumerate(objects) if isinstance(o, DataLoader)]
        for i in loaders:
            out[i] = self.prepare_data_loader(objects[i])
        models = [i for i, o in enumerate(objects) if isinstance(o, nn.Module)]
        optims = [i for i, o in enumerate(objects) if isinstance(o, torch.optim.Optimizer)]
        if len(models) > 1 or len(optims) > 1 or (models and self.engine is not None):
            raise ConfigError(
                "prepare: meshtrain's Accelerator drives one Engine: prepare one model with "
                "its one optimizer (use a second Accelerator for a second model)"
            )
        if models and not optims:
            raise ConfigError(
                "prepare: the model needs its optimizer in the same prepare() call (the "
                "engine builds its fp32 master weights and re-points the optimizer at them)"
            )
        if optims and not models:
            raise ConfigError("prepare: the optimizer needs its model in the same prepare() call")
        if models:
            engine = self._build_engine(objects[models[0]], objects[optims[0]])
            out[models[0]] = PreparedModel(engine)
            self._optimizer = out[optims[0]] = PreparedOptimizer(self, engine)
        for i, o in enumerate(objects):
            if (
                i not in loaders + models + optims
                and hasattr(o, "step")
                and hasattr(o, "optimizer")
            ):
                out[i] = self._prepare_scheduler(o)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_data_loader(self, loader: DataLoader) -> PreparedDataLoader:
        """The loader dealt over the data-parallel ranks: ``batch_size`` samples per rank,
        shuffled (seed ``self.seed`` + epoch) when the original was, resumable."""
        if loader.batch_size is None:
            raise ConfigError(
                "prepare: a DataLoader with a batch_sampler cannot be resharded; build it "
                "with batch_size= (and shuffle=) instead"
            )
        t = self.topology
        prepared = PreparedDataLoader(
            loader.dataset,
            int(loader.batch_size),
            device=self.device,
            num_replicas=t.dp_size,
            rank=t.dp_rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=self.seed,
            collate_fn=loader.collate_fn,
            drop_last=loader.drop_last,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
        )
        prepared.shuffle = isinstance(loader.sampler, RandomSampler)
        prepared.on_batch = self._set_active_loader
        self._loaders.append(prepared)
        return prepared

    def _set_active_loader(self, loader: PreparedDataLoader) -> None:
        self._active_loader = loader

    def _build_engine(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        from meshtrain.engine.start import start_engine

        cfg = engine_config(self._config, self._loaders, self.topology)
        self.engine = start_engine(model, cfg, topology=self.topology, optimizer=optimizer)
        return self.engine

    def _prepare_scheduler(self, scheduler) -> PreparedScheduler:
        if self.engine is None or scheduler.optimizer is not self.engine.optimizer:
            raise ConfigError(
                "prepare: a scheduler is prepared with (or after) the model and the optimizer "
                "it was built on"
            )
        prepared = PreparedScheduler(scheduler, self.engine)
        self._schedulers.append(prepared)
        return prepared

    # the step ----------------------------------------------------------------------------------
    def _need_engine(self):
        if self.engine is None:
            raise ConfigError("prepare(model, optimizer, ...) first")
        return self.engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward``: scaled by the loss scale and 1 / accumulation steps."""
        self._need_engine().backward(loss)

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step ends an accumulation window (the optimizer will step)."""
        if self._sync_gradients is not None:
            return self._sync_gradients
        return self.engine is None or self.engine.is_gradient_accumulation_boundary()

    @contextmanager
    def accumulate(self, *models: Any) -> Iterator[None]:
        """One micro-step of gradient accumulation; the engine reduces at the boundary,
        which the last batch of the prepared dataloader being iterated forces."""
        engine = self._need_engine()
        loader = self._active_loader
        left = 0 if loader is None else loader.batches_left  # this batch included
        if 0 < left < engine.gas and engine.micro_steps % engine.gas == 0:
            engine.shorten_window(left)  # the loader's short last window steps too
        self._sync_gradients = engine.is_gradient_accumulation_boundary()
        try:
            yield
        finally:
            self._sync_gradients = None

    @contextmanager
    def no_sync(self, model: Any = None) -> Iterator[None]:
        """Accumulate locally without communicating (ZeRO stages 0-1; see engine.no_sync)."""
        with self._need_engine().no_sync():
            yield

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the global gradient norm (over every shard) to ``max_norm`` in the next
        optimizer step and return the norm before clipping. Call it after the window's
        last backward (under ``if accelerator.sync_gradients``)."""
        if float(norm_type) != 2.0:
            raise ConfigError(
                f"clip_grad_norm_: norm_type={norm_type}; the engine clips the L2 norm"
            )
        return torch.tensor(self._need_engine().clip_grad_norm_(max_norm))

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        raise ConfigError(
            "clip_grad_value_: the engine clips the global L2 norm only; use clip_grad_norm_"
        )

    def _engine_step(self) -> bool:
        return self._need_engine().step()

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast`` in the mixed-precision dtype (a no-op in fp32)."""
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.mixed_precision)
        ctx = nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)
        with ctx:
            yield

    # cross-process helpers -----------------------------------------------------------------------
    def _dp(self):
        t = self.topology
        return (t.dp_group.pg if t.dp_size > 1 else None), t.dp_size

    def gather(self, data: Any) -> Any:
        """Every rank's tensors concatenated along dim 0 (same shapes on every rank)."""
        return col.gather(data, *self._dp())

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """``gather``, minus the rows the sampler repeated to even out the ranks: over a
        prepared loader's pass, each row of the dataset comes back exactly once (in
        dataset order for an unshuffled loader). Call it once per batch of the loader
        being iterated; non-tensor data (a list of rows) goes through ``gather_object``."""
        group, world = self._dp()
        loader = self._active_loader
        order = None if loader is None or world == 1 else col.exact_rows_order(*loader.batch_rows())
        if use_gather_object or not col.has_tensor(data):
            rows = [x for part in col.gather_object(list(data), group, world) for x in part]
            return rows if order is None else [rows[i] for i in order.tolist()]
        gathered = col.gather(data, group, world)
        return gathered if order is None else col._map(lambda t: t[order], gathered)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        return col.reduce(data, *self._dp(), reduction=reduction)

    def pad_across_processes(
        self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        group, world = self._dp()
        return col.pad_across_processes(data, group, world, dim, pad_index, pad_first)

    # models and state ----------------------------------------------------------------------------
    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The user's module (parameters sharded under ZeRO-3: see ``get_state_dict``)."""
        return model.engine.module if isinstance(model, PreparedModel) else model

    def get_state_dict(self, model: Any = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict, every parameter whole (gathered under ZeRO-3). Every rank
        must call it."""
        return self._need_engine().module_state_dict()

    def save_model(
        self,
        model: Any,
        save_directory: str | os.PathLike,
        *,
        merge_lora: bool = False,
        safe_serialization: bool = True,
    ) -> None:
        """Save the model for ``from_pretrained``: a peft model saves its adapter only (or,
        with ``merge_lora``, the base model with the adapter merged in); other models save
        ``save_pretrained`` folders or ``model.safetensors``. Every rank must call it."""
        from meshtrain.accelerate.peft_io import save_model, whole_for_save

        state = self.get_state_dict(model)
        unwrapped = self.unwrap_model(model)
        with whole_for_save(self.engine, unwrapped):  # collective under ZeRO-3
            if self.is_main_process:
                save_model(unwrapped, state, Path(save_directory), merge_lora=merge_lora)
        self.wait_for_everyone()

    def save_state(self, output_dir: str | os.PathLike) -> Path:
        """Everything for an exact resume: engine checkpoint (model, optimizer, counters,
        scaler), schedulers, loader positions and this rank's RNG states."""
        engine = self._need_engine()
        client = {
            "dataloaders": [dl.state_dict() for dl in self._loaders],
            "schedulers": [s.state_dict() for s in self._schedulers],
        }
        rank, rng = self.process_index, rng_state()  # the states at the save, not at the commit
        path = Path(
            engine.save_checkpoint(
                output_dir,
                tag="accelerator_state",
                client_state=client,
                # after the commit: in the background under checkpoint.async_save
                on_commit=lambda p: save_rng_state(Path(p), rank, rng),
            )
        )
        self.wait_for_everyone()
        return path

    def load_state(self, input_dir: str | os.PathLike) -> None:
        """Resume what ``save_state`` wrote (the same objects prepared in the same order)."""
        engine = self._need_engine()
        path, client = engine.load_checkpoint(input_dir, tag="accelerator_state")
        for dl, st in zip(self._loaders, client.get("dataloaders", []), strict=False):
            dl.load_state_dict(st)
        for s, st in zip(self._schedulers, client.get("schedulers", []), strict=False):
            s.load_state_dict(st)
        load_rng_state(Path(path), self.process_index)

    def end_training(self) -> None:
        self.wait_for_everyone()


__all__ = ["Accelerator"]
