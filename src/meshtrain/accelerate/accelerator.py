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
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from meshtrain.accelerate import collectives as col
from meshtrain.accelerate import processes
from meshtrain.accelerate.grads import EngineDriver
from meshtrain.accelerate.prepared import (
    PreparedDataLoader,
    PreparedModel,
    PreparedOptimizer,
    PreparedScheduler,
)
from meshtrain.accelerate.setup import (
    config_dict,
    engine_config,
    int_argument,
    load_rng_state,
    refuse_unsupported,
    save_rng_state,
)
from meshtrain.errors import ConfigError


class Accelerator:
    """accelerate's ``Accelerator`` on meshtrain Engines (see the module docstring).

    Args:
        mixed_precision: ``None`` / ``"no"`` (fp32), ``"fp16"`` (dynamic loss scaling) or
            ``"bf16"``.
        gradient_accumulation_steps: micro-batches per optimizer step.
        config: a meshtrain / DeepSpeed config (dict, JSON/YAML path or ``Config``): ZeRO
            stage, offload, mesh, clipping, ... Batch sizes are filled from the loader.
        seed: shuffle seed of the prepared training loaders (the same on every rank).
        cpu, device_placement, step_scheduler_with_optimizer, project_dir: accelerate's
            arguments of those names; the others accelerate has are refused by name.
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        config=None,
        *,
        seed: int = 0,
        cpu: bool = False,
        device_placement: bool = True,
        step_scheduler_with_optimizer: bool = True,
        project_dir: str | os.PathLike | None = None,
        **accelerate_kwargs: Any,
    ) -> None:
        refuse_unsupported(accelerate_kwargs)
        gas = int_argument("gradient_accumulation_steps", gradient_accumulation_steps, 1)
        self._config = config_dict(config, mixed_precision, gas)
        self.mixed_precision = mixed_precision or "no"
        self.gradient_accumulation_steps = int(self._config["gradient_accumulation_steps"])
        self.seed = int_argument("seed", seed, 0)
        self.device_placement = bool(device_placement)
        self.step_scheduler_with_optimizer = bool(step_scheduler_with_optimizer)
        self.project_dir = None if project_dir is None else str(project_dir)
        self._env, self.topology = self._join(cpu)
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
        from meshtrain.distributed.env import init_distributed
        from meshtrain.distributed.topology import Topology

        env = init_distributed()
        mesh = self._config.get("mesh") or {}
        topology = Topology(
            pp=int(mesh.get("pipeline_parallel_size", 1)),
            tp=int(mesh.get("tensor_parallel_size", 1)),
        )
        if cpu and topology.device.type != "cpu":
            raise ConfigError(
                f"Accelerator(cpu=True): this process runs on {topology.device}; meshtrain "
                "picks the device from the launcher's environment (hide the GPUs with "
                "CUDA_VISIBLE_DEVICES='' to train on CPU)"
            )
        return env, topology

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
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

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

    @property
    def engine(self):
        """The Engine of the (first) trained model; ``engines`` lists them all."""
        return self.engines[0] if self.engines else None

    @property
    def engines(self) -> list:
        return [m.engine for m in self._models if m.engine is not None]

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            torch.distributed.barrier()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (downloads, preprocessing), then the rest."""
        with self._first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The local main process of each node runs the block first, then the rest."""
        with self._first(self.is_local_main_process):
            yield

    @contextmanager
    def _first(self, first: bool) -> Iterator[None]:
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # decorators and splitting ------------------------------------------------------------------
    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on the main process only (None elsewhere)."""
        return processes.run_on(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on each node's local main process only."""
        return processes.run_on(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on the last process only."""
        return processes.run_on(lambda: self.is_last_process, function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        """Decorator: run on the process of global index ``process_index`` only
        (``@accelerator.on_process(process_index=1)``)."""
        if function is None:
            return lambda f: self.on_process(f, process_index)
        return processes.run_on(lambda: self.process_index == process_index, function)

    def on_local_process(
        self, function: Callable | None = None, local_process_index: int | None = None
    ):
        """Decorator: run on the process of local index ``local_process_index`` only."""
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index)
        return processes.run_on(lambda: self.local_process_index == local_process_index, function)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor or dict of those
        (``apply_padding``: equal lengths, for ``gather``); see ``processes``."""
        yield processes.split(inputs, self.num_processes, self.process_index, apply_padding)

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
        """The loader dealt over the data-parallel ranks: ``batch_size`` samples per rank,
        shuffled (seed ``self.seed`` + epoch) when the original was, resumable."""
        if isinstance(loader, PreparedDataLoader):
            return loader
        if loader.batch_size is None:
            raise ConfigError(
                "prepare: a DataLoader with a batch_sampler cannot be resharded; build it "
                "with batch_size= (and shuffle=) instead"
            )
        t = self.topology
        prepared = PreparedDataLoader(
            loader.dataset,
            int(loader.batch_size),
            device=self.device if self.device_placement else torch.device("cpu"),
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
        from meshtrain.engine.engine import Engine

        if self._config.get("fp16", {}).get("enabled") and self.engines:
            raise ConfigError(
                "mixed_precision='fp16' with a second trained model: each engine keeps "
                "its own dynamic loss scale and one backward can carry only one; train "
                "several models in bf16 or fp32"
            )
        cfg = engine_config(self._config, self._loaders, self.topology)
        engine = Engine(model.module, cfg, self.topology, optimizer=opt.optimizer)
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
        engine = drivers[0].engine
        multiplier = engine.scaler.scale / engine.zero.predivide
        for d in drivers:
            d.before_backward(sync)
        (loss.float() * multiplier).backward(**kwargs)
        for d in drivers:
            d.after_backward(sync, loss)
        if sync:
            self._average_plain_grads()

    def _average_plain_grads(self) -> None:
        """Models without an engine that this backward reached: average their gradients
        over dp, as DDP does (one all-reduce of their concatenation)."""
        group, world = self._dp()
        if world == 1:
            return
        grads = [
            p.grad
            for m in self._models
            if m.engine is None and m.__dict__.get("touched")
            for p in m.module.parameters()
            if p.grad is not None
        ]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat, group=group)
            flat /= world
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0):
        """Clip the gradients of ``parameters`` in place to a global norm of ``max_norm``
        and return the norm before clipping. At a synchronising step the gradients are
        the averaged global ones (every shard under ZeRO); inside a window, the local
        ones, as in accelerate."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        drivers = [
            m.driver for m in self._models if m.driver is not None and ids & m.driver.param_ids
        ]
        if not drivers or not self._sync:
            grads = [p for p in params if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type)
        if len(drivers) > 1:
            raise ConfigError(
                "clip_grad_norm_: the parameters belong to several prepared models; clip "
                "each model's parameters in its own call"
            )
        return drivers[0].clip_(params, float(max_norm), float(norm_type))

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp the gradients of ``parameters`` to ``[-clip_value, clip_value]`` in place
        (ZeRO stage 0: the ``p.grad`` views; the sharded stages refuse)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for m in self._models:
            d = m.driver
            if d is not None and d.stage > 0 and {id(p) for p in params} & d.param_ids:
                raise ConfigError(
                    f"clip_grad_value_: at ZeRO stage {d.stage} the gradient is sharded "
                    "and p.grad is not it; use clip_grad_norm_ (or ZeRO stage 0)"
                )
        torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], clip_value)

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
    def _prepared(self, model: Any) -> PreparedModel | None:
        if isinstance(model, PreparedModel):
            return model
        return next((m for m in self._models if m.module is model), None)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, **_: Any) -> nn.Module:
        """The user's module (parameters sharded under ZeRO-3: see ``get_state_dict``)."""
        prepared = self._prepared(model)
        return model if prepared is None else prepared.module

    def get_state_dict(self, model: Any = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict, every parameter whole (gathered under ZeRO-3). Every rank
        must call it. ``model`` defaults to the first prepared one."""
        prepared = self._prepared(model) if model is not None else (self._models or [None])[0]
        if prepared is None:
            if isinstance(model, nn.Module):
                return {k: v.detach().clone() for k, v in model.state_dict().items()}
            raise ConfigError("get_state_dict: prepare a model first")
        if prepared.engine is None:
            return {k: v.detach().clone() for k, v in prepared.module.state_dict().items()}
        return prepared.engine.module_state_dict()

    def save_model(
        self,
        model: Any,
        save_directory: str | os.PathLike,
        *,
        merge_lora: bool = False,
        safe_serialization: bool = True,
        max_shard_size: Any = None,
    ) -> None:
        """Save the model for ``from_pretrained``: a peft model saves its adapter only (or,
        with ``merge_lora``, the base model with the adapter merged in); other models save
        ``save_pretrained`` folders or ``model.safetensors``. Every rank must call it."""
        from meshtrain.accelerate.peft_io import save_model

        if not safe_serialization:
            raise ConfigError(
                "save_model(safe_serialization=False): meshtrain writes safetensors only "
                "(pickled weights can run code when loaded)"
            )
        state = self.get_state_dict(model)
        if self.is_main_process:
            save_model(self.unwrap_model(model), state, Path(save_directory), merge_lora=merge_lora)
        self.wait_for_everyone()

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write ``obj`` once (main process): a dict of tensors as safetensors, anything
        else with ``torch.save`` as accelerate does."""
        if self.is_main_process:
            if safe_serialization:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in obj.items()}, str(f))
            else:
                torch.save(obj, f)
        self.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (JSON-able state) that
        ``save_state`` / ``load_state`` carry too."""
        bad = [
            o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            raise ValueError(
                "register_for_checkpointing: these objects have no state_dict / "
                f"load_state_dict: {[type(o).__name__ for o in bad]}"
            )
        self._custom.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, **_: Any) -> Path:
        """Everything for an exact resume: each engine's checkpoint (model, optimizer,
        counters, scaler), models without an engine, schedulers, loader positions,
        registered objects and this rank's RNG states."""
        if output_dir is None:
            if self.project_dir is None:
                raise ConfigError("save_state(): give output_dir or Accelerator(project_dir=)")
            output_dir = Path(self.project_dir) / "checkpoints"
        out = Path(output_dir)
        client = {
            "dataloaders": [dl.state_dict() for dl in self._loaders],
            "schedulers": [s.state_dict() for s in self._schedulers],
            "custom": [o.state_dict() for o in self._custom],
            "step": self.step,
        }
        path = out
        for i, engine in enumerate(self.engines):
            saved = engine.save_checkpoint(out, tag=_tag(i), client_state=client if i == 0 else {})
            path = Path(saved) if i == 0 else path
        out.mkdir(parents=True, exist_ok=True)
        if not self.engines:
            if self.is_main_process:
                import json

                (out / "accelerator_client.json").write_text(json.dumps(client), encoding="utf-8")
            path = out
        if self.is_main_process:
            from safetensors.torch import save_file

            for i, m in enumerate(self._models):
                if m.engine is None:
                    state = {k: v.contiguous() for k, v in m.module.state_dict().items()}
                    save_file(state, str(out / f"model_{i}.safetensors"))
        save_rng_state(Path(path), self.process_index)
        self.wait_for_everyone()
        return path

    def load_state(self, input_dir: str | os.PathLike, **_: Any) -> None:
        """Resume what ``save_state`` wrote (the same objects prepared in the same order)."""
        import json

        inp = Path(input_dir)
        client: dict = {}
        path = inp
        for i, engine in enumerate(self.engines):
            loaded, got = engine.load_checkpoint(inp, tag=_tag(i))
            if loaded is None:
                raise ConfigError(f"load_state: no checkpoint '{_tag(i)}' under {inp}")
            if i == 0:
                path, client = Path(loaded), got or {}
        if not self.engines and (inp / "accelerator_client.json").exists():
            client = json.loads((inp / "accelerator_client.json").read_text(encoding="utf-8"))
        from safetensors.torch import load_file

        for i, m in enumerate(self._models):
            f = inp / f"model_{i}.safetensors"
            if m.engine is None and f.exists():
                m.module.load_state_dict(load_file(str(f), device=str(self.device)))
        for dl, st in zip(self._loaders, client.get("dataloaders", []), strict=False):
            dl.load_state_dict(st)
        for s, st in zip(self._schedulers, client.get("schedulers", []), strict=False):
            s.load_state_dict(st)
        for o, st in zip(self._custom, client.get("custom", []), strict=False):
            o.load_state_dict(st)
        self.step = int(client.get("step", 0))
        load_rng_state(Path(path), self.process_index)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Refused: ``load_state`` already resumes every prepared loader at the exact
        batch it stopped at, so skipping again would lose batches."""
        raise ConfigError(
            "skip_first_batches: not needed with meshtrain: load_state restores each "
            "prepared loader's position, and the next batch is the one after the save"
        )

    def free_memory(self, *objects: Any) -> tuple:
        """Drop every reference the Accelerator holds (engines, loaders, ...)."""
        for m in self._models:
            if m.driver is not None:
                m.driver.remove()
            for h in m.__dict__.pop("hooks", []):
                h.remove()
        self._models, self._optimizers, self._loaders = [], [], []
        self._schedulers, self._custom = [], []
        self._active_loader = None
        self.step = 0
        return tuple(None for _ in objects)

    clear = free_memory

    # trackers: accelerate's meaning without ``log_with`` (none configured): nothing ----------------
    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs=None
    ) -> None:
        """No tracker is configured (``log_with`` is refused), so nothing to start."""

    def log(self, values: dict, step: int | None = None, log_kwargs=None) -> None:
        """No tracker is configured, so nothing is logged (accelerate's behaviour)."""

    def get_tracker(self, name: str, unwrap: bool = False):
        raise ConfigError(
            f"get_tracker({name!r}): meshtrain's Accelerator has no trackers (log_with is "
            "not supported); log with TensorBoard/JSONL yourself on the main process"
        )

    def end_training(self) -> None:
        self.wait_for_everyone()

    # triggers: a flag any rank sets, every rank sees -----------------------------------------------
    def set_trigger(self) -> None:
        self._trigger = True

    def check_trigger(self) -> bool:
        flag = torch.tensor([1 if getattr(self, "_trigger", False) else 0], device=self.device)
        if self.num_processes > 1:
            torch.distributed.all_reduce(flag)
        self._trigger = False
        return bool(flag.item() > 0)


def _tag(i: int) -> str:
    return "accelerator_state" if i == 0 else f"accelerator_state_{i}"


def _is_scheduler(o: Any) -> bool:
    return (
        not isinstance(o, nn.Module | torch.optim.Optimizer | DataLoader)
        and hasattr(o, "step")
        and hasattr(o, "optimizer")
    )


__all__ = ["Accelerator"]
