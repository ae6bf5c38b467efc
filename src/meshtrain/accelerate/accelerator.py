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
from pathlib import Path
from typing import Any

import torch

from meshtrain.accelerate.engine_config import (
    config_dict,
    dataloader_options,
    int_argument,
    refuse_unsupported,
)
from meshtrain.accelerate.forwarded import Forwarded
from meshtrain.accelerate.grads import (
    average_plain_grads,
    clip_grad_norm,
    clip_grad_value,
)
from meshtrain.accelerate.prepared_objects import PreparedObjects
from meshtrain.accelerate.preparer import Preparer
from meshtrain.accelerate.process_queries import ProcessQueries
from meshtrain.accelerate.skipped_loader import SkippedLoader
from meshtrain.accelerate.state_io import StateIO
from meshtrain.accelerate.trackers.choice import Trackers
from meshtrain.distributed.env import read_env
from meshtrain.engine.start import join_mesh
from meshtrain.errors import ConfigError


class Accelerator:
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
        env, self.topology = self._join(cpu)
        self.log_with = log_with
        self.step = 0  # micro-steps counted by accumulate() (accelerate's ``step``)
        self._sync = True
        self._local = 0  # depth of no_sync()
        # the collaborators: each job in its own class, accelerate's names forwarded
        self.prepared = PreparedObjects()  # what prepare() returned, in prepare order
        self.preparer = Preparer(self, self.prepared, self._config)
        self.processes = ProcessQueries(self.topology, env.local_rank)
        self.state_io = StateIO(self.prepared, self.processes)
        self.tracking = Trackers(log_with, self.project_dir, self.topology.rank == 0)

    def _join(self, cpu: bool):
        """Join the process group and build the mesh (the one set-up call)."""
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
        return self.prepared.engines

    # prepare: ``preparer`` ------------------------------------------------------------------
    prepare = Forwarded("preparer", Preparer)
    prepare_model = Forwarded("preparer", Preparer)
    prepare_optimizer = Forwarded("preparer", Preparer)
    prepare_scheduler = Forwarded("preparer", Preparer)
    prepare_data_loader = Forwarded("preparer", Preparer)

    # where this process is, what runs where, collectives: ``processes`` ------------------------
    process_index = Forwarded("processes", ProcessQueries)
    local_process_index = Forwarded("processes", ProcessQueries)
    num_processes = Forwarded("processes", ProcessQueries)
    is_main_process = Forwarded("processes", ProcessQueries)
    is_local_main_process = Forwarded("processes", ProcessQueries)
    is_last_process = Forwarded("processes", ProcessQueries)
    use_distributed = Forwarded("processes", ProcessQueries)
    device = Forwarded("processes", ProcessQueries)
    distributed_type = Forwarded("processes", ProcessQueries)
    wait_for_everyone = Forwarded("processes", ProcessQueries)
    main_process_first = Forwarded("processes", ProcessQueries)
    local_main_process_first = Forwarded("processes", ProcessQueries)
    print = Forwarded("processes", ProcessQueries)
    on_main_process = Forwarded("processes", ProcessQueries)
    on_local_main_process = Forwarded("processes", ProcessQueries)
    on_last_process = Forwarded("processes", ProcessQueries)
    on_process = Forwarded("processes", ProcessQueries)
    on_local_process = Forwarded("processes", ProcessQueries)
    split_between_processes = Forwarded("processes", ProcessQueries)
    gather = Forwarded("processes", ProcessQueries)
    reduce = Forwarded("processes", ProcessQueries)
    pad_across_processes = Forwarded("processes", ProcessQueries)
    set_trigger = Forwarded("processes", ProcessQueries)
    check_trigger = Forwarded("processes", ProcessQueries)

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` minus the rows the sampler repeated at the loader's end
        (``ProcessQueries.gather_for_metrics``, over the loader being iterated)."""
        loader = self.prepared.active_loader
        return self.processes.gather_for_metrics(data, use_gather_object, loader)

    # trackers: accelerate's calls on ``log_with``'s trackers (``trackers.choice``) -------------
    @property
    def trackers(self) -> list:
        return self.tracking.trackers

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs=None
    ) -> None:
        """Start ``log_with``'s trackers under ``project_dir/project_name`` and store
        ``config`` as the run's hyperparameters (main process)."""
        self.tracking.init(project_name, config, init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs=None) -> None:
        """Log ``values`` to every tracker (main process; elsewhere nothing)."""
        self.tracking.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False):
        return self.tracking.get(name, unwrap)

    def end_training(self) -> None:
        """Close the trackers, then wait for every process."""
        self.tracking.finish()
        self.wait_for_everyone()

    # models and saved state: ``state_io`` ------------------------------------------------------
    unwrap_model = Forwarded("state_io", StateIO)
    get_state_dict = Forwarded("state_io", StateIO)
    save_model = Forwarded("state_io", StateIO)
    save = Forwarded("state_io", StateIO)
    register_for_checkpointing = Forwarded("state_io", StateIO)

    def save_state(self, output_dir: str | os.PathLike | None = None, **_: Any) -> Path:
        """Everything for an exact resume (``StateIO.save_state``), under
        ``project_dir/checkpoints`` when ``output_dir`` is not given."""
        return self.state_io.save_state(output_dir, self.step, self.project_dir)

    def load_state(self, input_dir: str | os.PathLike, **_: Any) -> None:
        """Resume what ``save_state`` wrote, meshtrain's or accelerate's
        (``StateIO.load_state``): the same objects prepared in the same order."""
        self.step = self.state_io.load_state(input_dir, self.step)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's: the loader of one pass from its ``num_batches``-th batch
        (``skipped_loader``); after ``load_state`` at that batch it changes nothing."""
        return SkippedLoader(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> tuple:
        """Drop every reference the Accelerator holds (engines, loaders, ...)."""
        self.prepared.clear()
        self.step = 0
        return tuple(None for _ in objects)

    clear = free_memory

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
        loader = self.prepared.active_loader
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
        every backward anyway: their gradients are sharded, and an accumulated window's
        result is the same; a step after a window all inside, local SGD, is refused at
        stages 1-3: ``EngineDriver.keep_local``)."""
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
        for m in self.prepared.models:
            m.__dict__["touched"] = False
        drivers = [m.driver for m in self.prepared.models if m.driver is not None]
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
        average_plain_grads(self.prepared.models, *self.processes.dp())

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0):
        """Clip the gradients of ``parameters`` in place to a global norm of ``max_norm``
        and return the norm before clipping. At a synchronising step the gradients are
        the averaged global ones (every shard under ZeRO); inside a window, the local
        ones, as in accelerate."""
        return clip_grad_norm(self.prepared.models, parameters, max_norm, norm_type, self._sync)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp the gradients of ``parameters`` to ``[-clip_value, clip_value]`` in place
        (ZeRO stage 0: the ``p.grad`` views; the sharded stages refuse)."""
        clip_grad_value(self.prepared.models, parameters, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """fp16: the gradients are unscaled by ``clip_grad_norm_``; nothing to do here."""

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow)."""
        return any(o.step_was_skipped for o in self.prepared.optimizers)

    @contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """``torch.autocast`` in the mixed-precision dtype (a no-op in fp32)."""
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.mixed_precision)
        ctx = nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)
        with ctx:
            yield


__all__ = ["Accelerator"]
