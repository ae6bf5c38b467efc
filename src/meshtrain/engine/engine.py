"""The Engine: the one training step every way into meshtrain (initialize, prepare,
Trainer, ``meshtrain train``) runs on.

``meshtrain.initialize`` follows DeepSpeed so scripts port with an import change::

    engine, optimizer, dataloader, lr_scheduler = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json",
        training_data=dataset)
    for batch in dataloader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()        # acts only at the gradient-accumulation boundary

One step, in order: forward in the model dtype -> backward of ``loss * scale / k``
(``k`` = gradient_accumulation_steps), with gradient buckets reduced asynchronously as
they fill on the boundary micro-step (``GradReducer``) -> wait -> global gradient norm
(sum of squares of the gradient chunks this rank owns, all-reduced when they are
sharded) -> on inf/NaN skip everywhere and lower the loss scale, else scale by
``clip / loss_scale`` and step the fp32 masters -> write masters back to the model
(all-gather the chunks under ZeRO) -> LR schedule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from meshtrain.distributed import comm
from meshtrain.distributed.topology import Topology
from meshtrain.errors import ConfigError, TrainingError
from meshtrain.optim.setup import make_optimizer, make_scheduler, param_groups
from meshtrain.parallel.grad_reducer import GradReducer
from meshtrain.parallel.zero.plan import build_plan, gather_updated_params
from meshtrain.precision import DTYPES, scaler_from_config
from meshtrain.engine.step_log import StepLog

log = logging.getLogger("meshtrain")


class Engine:
    """Wraps a model with its optimizer, precision, gradient reduction and schedule.

    Build it with ``meshtrain.initialize``; see the module docstring for the step.
    """

    def __init__(
        self,
        model: nn.Module,
        config,
        topology: Topology,
        model_parameters=None,
        optimizer=None,
        lr_scheduler=None,
    ) -> None:
        self.config = config
        self.topology = topology
        self.device = topology.device
        self.dtype = DTYPES[config.precision]
        self.zero_stage = int(config.zero_optimization.stage)
        self.gas = int(config.gradient_accumulation_steps)
        self.micro_batch_size = int(config.train_micro_batch_size_per_gpu)
        self.clip = float(config.gradient_clipping or 0.0)
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._global_grad_norm: float | None = None
        self.training_dataloader = None  # set by initialize(training_data=...)

        model = model.to(device=self.device, dtype=self.dtype)
        self._apply_activation_checkpointing(model)
        self.module = model
        self._broadcast_model()

        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model_parameters or model.parameters())  # a factory
        groups = (
            [dict(g) for g in optimizer.param_groups]
            if optimizer is not None
            else param_groups(model, model_parameters)
        )
        groups = param_groups(model, groups)
        self.plan = build_plan(model, groups, config, topology, self.zero_stage)
        self.flat_groups = self.plan.flat_groups
        self.gatherer = self.plan.gatherer
        self.optimizer = make_optimizer(config, optimizer, groups, self.plan, self.device)
        self.lr_scheduler = make_scheduler(config, lr_scheduler, self.optimizer)
        self.reducer = GradReducer(
            self.flat_groups,
            topology.dp_group,
            on_reduced=(lambda g, b: g.release(b)) if self.gatherer is not None else None,
        )
        self.scaler = scaler_from_config(config)
        self.log = StepLog(self, every=int(config.steps_per_print or 0))
        self._step_comm: dict[str, int] = {}
        self._comm_mark = topology.stats.snapshot()
        if config.compile.active:
            c = config.compile
            self.module.compile(
                backend=c.backend,
                mode=c.mode,
                fullgraph=c.fullgraph,
                dynamic=c.dynamic,
                options=c.options,
                **c.kwargs,
            )

    # set-up --------------------------------------------------------------------------------
    def _broadcast_model(self) -> None:
        """Start every data-parallel replica from rank 0's weights and buffers."""
        if self.topology.dp_size == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast(t.data, 0, self.topology.dp_group, label="init")

    def _apply_activation_checkpointing(self, model: nn.Module) -> None:
        ac = self.config.activation_checkpointing
        if not ac.enabled:
            return
        from meshtrain.parallel.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, ac.module_classes)

    # the training step ----------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last of its accumulation window."""
        return (self.micro_steps + 1) % self.gas == 0

    def _to_device(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.to(self.device, non_blocking=True)
            return x.to(self.dtype) if x.is_floating_point() and self.dtype != torch.float32 else x
        if isinstance(x, dict):
            return {k: self._to_device(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(self._to_device(v) for v in x)
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model. ``engine(batch)`` with a dict calls ``model(**batch)``, with a
        tuple/list ``model(*batch)``; ``engine(x, y)`` passes both."""
        args, kwargs = self._to_device(args), self._to_device(kwargs)
        if len(args) == 1 and not kwargs:
            if isinstance(args[0], dict):
                kwargs, args = args[0], ()
            elif isinstance(args[0], list | tuple):
                args = tuple(args[0])
        self.log.count_batch(args, kwargs)
        return self.module(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: Any) -> None:
        """Backward of ``loss * loss_scale / gradient_accumulation_steps``; on the boundary
        micro-step gradient buckets are reduced while backward runs."""
        if hasattr(loss, "loss"):  # a transformers ModelOutput
            loss = loss.loss
        if self.micro_steps % self.gas == 0:
            for g in self.flat_groups:
                g.attach_grads()
        self.log.add_loss(loss.detach())
        if self.reducer.every_backward:  # ZeRO 2/3: reduce now, keep only the shard
            (loss.float() * (self.scaler.scale / self.gas)).backward()
            self.reducer.finish()
            if self.gatherer is not None:
                self.gatherer.release_all()  # units whose parameters got no gradient
            return
        sync_before = self.reducer.sync
        self.reducer.sync = sync_before and self.is_gradient_accumulation_boundary()
        try:
            (loss.float() * (self.scaler.scale / self.gas)).backward()
        finally:
            self.reducer.sync = sync_before

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally without communicating (DDP's ``no_sync``)."""
        if self.reducer.every_backward:
            raise TrainingError(
                f"no_sync: ZeRO stage {self.zero_stage} reduce-scatters gradients on every "
                "backward (no rank keeps a full gradient to accumulate into); use "
                "gradient_accumulation_steps, or ZeRO stage 0/1 to accumulate locally"
            )
        with self.reducer.no_sync():
            yield

    def step(self) -> None:
        """Count the micro-step; at the accumulation boundary update the parameters."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if not self.reducer.every_backward:
            self.reducer.finish()
        # the reduction summed over dp ranks: fold the average into the scaling
        scale = self.scaler.scale * self.topology.dp_size
        norm = self._grad_norm()  # of the loss-scaled, dp-summed gradients
        overflow = not math.isfinite(norm)
        self.last_step_skipped = overflow
        if overflow:
            self._global_grad_norm = None
            self.skipped_steps += 1
        else:
            self._global_grad_norm = norm / scale
            factor = 1.0 / scale
            if self.clip > 0:
                factor *= min(1.0, self.clip / (self._global_grad_norm + 1e-6))
            for g in self.flat_groups:
                g.load_master_grads(factor)
            self.optimizer.step()
            for g in self.flat_groups:
                g.release_master_grads()
                g.copy_master_to_params()
            gather_updated_params(self.flat_groups, self.topology.dp_group)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        for g in self.flat_groups:
            g.zero_grads()
        self.scaler.update(overflow)
        self.global_steps += 1
        now = self.topology.stats.snapshot()
        self._step_comm = comm.CommStats.diff(now, self._comm_mark)
        self._comm_mark = now
        self.log.end_step()

    def _grad_norm(self) -> float:
        """L2 norm over every rank's owned gradient chunks (inf/NaN if any overflowed)."""
        parts = [
            torch.linalg.vector_norm(c, dtype=torch.float32)
            for g in self.flat_groups
            for c in g.grad_chunks
        ]
        sq = torch.stack(parts).pow(2).sum() if parts else torch.zeros((), device=self.device)
        if any(g.partitions > 1 for g in self.flat_groups):
            comm.all_reduce(sq, self.topology.dp_group, label="control")
        return float(sq.sqrt())

    # queries ----------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm of the last step before clipping (None if it overflowed)."""
        return self._global_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def last_step_comm_bytes(self) -> dict[str, int]:
        """Bytes the last optimizer step recorded, by op kind, plus ``"total"``."""
        by_op: dict[str, int] = {}
        for (op, _group), n in self._step_comm.items():
            by_op[op] = by_op.get(op, 0) + n
        by_op["total"] = sum(by_op.values())
        return by_op

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict (every parameter whole, gathered under ZeRO-3)."""
        with self.gathered_parameters():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    @contextmanager
    def gathered_parameters(self, module: nn.Module | None = None):
        """Under ZeRO-3, make ``module``'s parameters (default: all) whole for the block
        (evaluation, export, generation); they are freed again on exit. Changes made to
        them inside are not kept. A no-op for stages 0-2. Every rank must enter it."""
        if self.gatherer is None:
            yield
            return
        wanted = None if module is None else {id(p) for p in module.parameters()}
        buckets = [
            (g, b)
            for g in self.gatherer.groups
            for b in g.buckets
            if wanted is None or any(id(p) in wanted for p in b.params)
        ]
        for g, b in buckets:
            g.start_gather(b, self.topology.dp_group, comm)
        for g, b in buckets:
            g.finish_gather(b)
        try:
            yield
        finally:
            for g, b in buckets:
                g.release(b)

    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: dict | None = None):
        """Write a sharded checkpoint ``save_dir/tag`` (default ``global_step<N>``) and
        point ``save_dir/latest`` at it once every rank's files are complete. Every rank
        calls it; ``client_state`` must be JSON-able. Returns the checkpoint directory."""
        from meshtrain.checkpoint.engine_io import save

        return save(self, save_dir, tag, client_state)

    def load_checkpoint(
        self,
        load_dir,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ):
        """Load ``load_dir/tag`` (default: the tag ``latest`` names), written under any
        data-parallel size or ZeRO stage. Returns ``(load_path, client_state)``."""
        from meshtrain.checkpoint.engine_io import load

        return load(
            self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )

    def memory_report(self):
        """This rank's bytes of parameters, gradients and optimizer states beside the
        ZeRO-paper formula (``meshtrain.engine.memory.MemoryReport``; print it)."""
        from meshtrain.engine.memory import memory_report

        return memory_report(self)

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.module.parameters()


def initialize(
    model: nn.Module,
    model_parameters=None,
    config=None,
    training_data=None,
    collate_fn=None,
    optimizer=None,
    lr_scheduler=None,
    topology: Topology | None = None,
    *,
    args=None,
    config_params=None,
):
    """DeepSpeed-style entry: returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` is a dict, a JSON/YAML path or a ``Config``; ``topology`` defaults to the
    mesh the config's ``mesh`` section describes over the whole world. ``dataloader`` is
    None unless ``training_data`` is given; it deals disjoint shards to data-parallel
    ranks with ``train_micro_batch_size_per_gpu`` samples per batch.
    """
    from meshtrain.config import load_config
    from meshtrain.distributed.env import init_distributed

    config = config if config is not None else config_params
    if config is None:
        raise ConfigError("config: meshtrain.initialize needs a config (dict, path or Config)")
    cfg = load_config(config)
    init_distributed(timeout_minutes=cfg.distributed.timeout_minutes)
    if topology is None:
        topology = Topology(pp=cfg.mesh.pipeline_parallel_size, tp=cfg.mesh.tensor_parallel_size)
    cfg = cfg.resolve_auto_defaults().resolve_batch_sizes(topology.dp_size)
    engine = Engine(model, cfg, topology, model_parameters, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:  # (its position is saved with the engine's checkpoints)
        from meshtrain.data.loader import ResumableDataLoader

        loader = ResumableDataLoader(
            training_data,
            cfg.train_micro_batch_size_per_gpu,
            num_replicas=topology.dp_size,
            rank=topology.dp_rank,
            collate_fn=collate_fn,
        )
        engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


__all__ = ["Engine", "initialize"]
