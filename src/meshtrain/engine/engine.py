"""The Engine: the one training step every way into meshtrain (initialize, prepare,
Trainer, ``meshtrain train``) runs on.

One step, in order::

    engine(*inputs)        module(*inputs, **kwargs) in the model dtype (as DeepSpeed)
    engine.backward(loss)  backward of loss x scale / (k x f)   (k: accumulation steps,
                           f: gradient pre-division); buckets reduce as they fill;
                           at the boundary averaged in place (``zero.average_``)
    engine.step()          at the accumulation boundary: global gradient norm over every
                           shard -> on inf/NaN skip everywhere and lower the loss scale,
                           else scale by clip / (loss scale x dp / f) and step the fp32
                           masters -> write back (all-gather under ZeRO) -> LR schedule

What is sharded, reduced and gathered, and when, and what the gradients carry, is the
``ZeroStage`` (``meshtrain.parallel.zero.stage``) that ``parallelize`` built; the Engine
calls its lifecycle and gradient contract in the order above, never looks at the stage
itself and touches none of its buffers.
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
from meshtrain.distributed.env import read_env
from meshtrain.distributed.timeouts import settle_timeout
from meshtrain.distributed.topology import Topology
from meshtrain.dtypes import PRECISIONS
from meshtrain.engine.batches import eval_batch, train_batch
from meshtrain.engine.step_log import StepLog
from meshtrain.engine.visible_grads import attach
from meshtrain.engine.window import AccumulationWindow
from meshtrain.errors import ConfigError, TrainingError
from meshtrain.optim.builders import make_optimizer, make_scheduler
from meshtrain.parallel.compose import parallelize
from meshtrain.parallel.zero.partition import adopt
from meshtrain.parallel.zero.rebound import adopt_rebound
from meshtrain.precision import scaler_from_config

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
        training_dataloader=None,
        *,
        tp_plan=None,
    ) -> None:
        self.config = config
        self.topology = topology
        self.device = topology.device
        self.dtype = PRECISIONS[config.precision]
        self.zero_stage = int(config.zero_optimization.stage)
        self.gas = int(config.gradient_accumulation_steps)
        self.micro_batch_size = int(config.train_micro_batch_size_per_gpu)
        self.clip = float(config.gradient_clipping or 0.0)
        self._clip_once: float | None = None  # clip_grad_norm_'s max_norm for one step
        self._norm_once: float | None = None  # and the norm it computed (reused by step)
        self.training_dataloader = training_dataloader
        self._train_iter = None  # train_batch()'s own pass over training_dataloader
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._settled = False  # whether the steady collective timeout is in force
        self._global_grad_norm: float | None = None

        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model_parameters or model.parameters())  # a factory
        wanted = [dict(g) for g in optimizer.param_groups] if optimizer else model_parameters
        parallel = parallelize(model, topology, config, wanted, tp_plan=tp_plan)
        self.module = parallel.module
        self.zero = parallel.zero
        self.pipeline = parallel.pipeline  # PipelineRuntime when pp > 1, else None
        # zero.Init leftovers made whole; owners recorded for zero.GatheredParameters
        adopt(self.module, self.zero)
        attach(self)  # safe_get_full_grad finds the engine from the parameter
        self.optimizer = make_optimizer(config, optimizer, parallel.groups, self.zero, self.device)
        self.lr_scheduler = make_scheduler(config, lr_scheduler, self.optimizer)
        self.scaler = scaler_from_config(config)
        self.log = StepLog(
            every=int(config.steps_per_print or 0),
            dp_size=topology.dp_size,
            is_logging_rank=topology.rank == 0,
            breakdown=bool(config.wall_clock_breakdown),
            device=self.device,
        )
        # every way in (backward, the Accelerator, a pipeline's schedule) runs its windows
        # through this one driver of the ZeRO lifecycle (engine/window.py)
        self.window = AccumulationWindow(self.zero, self.scaler, self.log, self.gas)
        from meshtrain.engine.flops import attach_mfu

        attach_mfu(self.log, model, self.zero, self.device, self.dtype)
        from meshtrain.estimate.activations import attach_activations

        attach_activations(self.log, model, topology, config, self.dtype)  # | act MB/rank
        from meshtrain.parallel.experts.load import ExpertLoad

        # MoE: tokens per expert and all-to-all bytes in the step log, expert-bias updates
        self.expert_load = ExpertLoad.on_mesh(self.module, topology)
        self._step_comm: dict[tuple[str, str], int] = {}
        self._comm_mark = topology.stats.snapshot()
        self.checkpoint_saver = None  # AsyncSaver, made by the first async save
        self.preemption = None  # PreemptionGuard under checkpoint.save_on_preemption
        if config.checkpoint.save_on_preemption:
            from meshtrain.engine.preemption import PreemptionGuard

            self.preemption = PreemptionGuard().install()

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
        """Run the model on the arguments exactly as given: ``engine(batch)`` calls
        ``module(batch)``, ``engine(x, y)`` ``module(x, y)``, ``engine(**batch)``
        ``module(**batch)`` (DeepSpeed's ``forward(*inputs, **kwargs)``). Nothing is
        unpacked, so a model whose ``forward`` takes one batch object gets that object.
        Tensors are moved to ``engine.device`` and floating ones cast to the model dtype
        on the way (a DeepSpeed script has done both already: a no-op for it)."""
        args, kwargs = self._to_device(args), self._to_device(kwargs)
        adopt_rebound(self.zero.flat_groups)  # LocalSGD (parallel.zero.rebound)
        self.log.count_batch(*_counted(args, kwargs))
        with self.log.timed("forward"):
            return self.module(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: Any, weight: float | None = None) -> None:
        """Backward of ``loss * loss_scale / gradient_accumulation_steps``; gradient
        buckets are reduced while backward runs (see the ZeRO stage for when).

        ``weight``: the loss's weight in the step's gradient, which is then the sum over
        the data-parallel ranks and the window's micro-batches of ``weight x grad(loss)``
        (the Trainer: ``n / N``, its micro-batch's share of the step's label items).
        None is DeepSpeed's mean, ``1 / (gradient_accumulation_steps x dp)``. The step
        log records ``loss x weight x gas x dp``: what the loss counts for in that mean."""
        if hasattr(loss, "loss"):  # a transformers ModelOutput
            loss = loss.loss
        if self.micro_steps % self.gas == 0:
            self.window.open()
        logged = loss.detach()
        if weight is not None:
            logged = logged * (weight * self.gas * self.topology.dp_size)
        self.log.add_loss(logged)
        self.window.backward(loss, self.is_gradient_accumulation_boundary(), weight)

    def micro_batches(self, data_iter, m: int) -> list:
        """``m`` batches of ``data_iter`` (None: of the training loader), on device."""
        if data_iter is None and self.training_dataloader is None:
            raise ConfigError("give train_batch() a data iterator, or initialize training_data")
        if data_iter is None:
            if self._train_iter is None:
                self._train_iter = iter(self.training_dataloader)
            data_iter = self._train_iter
        try:
            return [self._to_device(next(data_iter)) for _ in range(m)]
        except StopIteration:
            raise ConfigError(
                f"the data iterator ran out before giving {m} micro-batches "
                "(gradient_accumulation_steps) for this step"
            ) from None

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from
        ``data_iter`` (default: the training data loader); returns the mean loss on every
        rank. The way to train with pipeline parallelism; works at any mesh."""
        return train_batch(self, data_iter)

    def eval_batch(self, data_iter=None, num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over ``num_micro_batches`` (default gradient_accumulation_steps)
        micro-batches of any shapes, without gradients; on every rank."""
        return eval_batch(self, data_iter, num_micro_batches)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally without communicating (DDP's ``no_sync``)."""
        with self.zero.no_sync():
            yield

    @contextmanager
    def between_steps(self):
        """Work between optimizer steps that is not training (an evaluation): its time and
        bytes stay out of the next step's seconds, tokens/s and comm."""
        yield
        self._comm_mark = self.topology.stats.snapshot()
        self.log.restart_clock()

    def shorten_window(self, micro_batches: int) -> None:
        """Make the coming accumulation window ``micro_batches`` long (fewer than
        gradient_accumulation_steps: the short last window of an epoch), so its last
        micro-step steps. Call it before the window's first backward. The loss is still
        divided by gradient_accumulation_steps, as accelerate does; scale it yourself
        for a mean over the shorter window."""
        if self.micro_steps % self.gas:
            raise TrainingError(
                "shorten_window: call it before the window's first backward (this window "
                f"has run {self.micro_steps % self.gas} of {self.gas} micro-steps)"
            )
        if not 1 <= micro_batches <= self.gas:
            raise ValueError(f"shorten_window: micro_batches={micro_batches}, not 1..{self.gas}")
        if micro_batches < self.gas:
            self.window.open()  # backward() opens windows at multiples of gas only
            self.micro_steps += self.gas - micro_batches

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Finish this window's gradient reduction now and return the global gradient
        norm (unscaled, over every shard); the coming ``step()`` clips to ``max_norm``
        instead of ``gradient_clipping``. Call it after the window's last backward."""
        self.zero.before_step()  # reduces once, however often it is called in a window
        self._clip_once = float(max_norm)
        self._norm_once = self.scaled_grad_norm()  # gradients are final: step() reuses it
        return self._norm_once / self.zero.grad_scale

    def scaled_grad_norm(self) -> float:
        """The global gradient norm as the gradients carry it now (``zero.grad_scale``
        times the true one), over every shard and stage."""
        if self.pipeline is None:
            return self.zero.grad_norm()
        from meshtrain.parallel.pipeline.engine_step import global_grad_norm

        return global_grad_norm(self.pipeline, self.zero)  # over every stage

    @property
    def clipped_this_step(self) -> bool:
        """Whether this window's gradients were clipped in place already (``clipped``)."""
        return self._clip_once == 0.0

    def clipped(self, norm: float) -> None:
        """The window's gradients were clipped in place (the Accelerator's
        ``clip_grad_norm_``): the step clips no more and reports ``norm`` (inf/NaN: it
        skips)."""
        self._clip_once, self._norm_once = 0.0, norm

    def step(self) -> bool:
        """Count the micro-step; at the accumulation boundary update the parameters.

        Returns True when this call ended an accumulation window (``global_steps``
        advanced). ``was_step_applied()`` then says whether the parameters changed: False
        when the step was skipped because a gradient was inf/NaN.
        """
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        with self.log.timed("step"):
            self._optimizer_step()
        if not self._settled:  # distributed.first_step_timeout_minutes ends here
            self._settled = True
            settle_timeout(self.config.distributed, self.topology.stats.ledger)
        now = self.topology.stats.snapshot()
        self._step_comm = comm.CommStats.diff(now, self._comm_mark)
        self._comm_mark = now
        moe = self.expert_load.end_step(self._step_comm) if self.expert_load else None
        self.log.end_step(
            step=self.global_steps,
            lr=self.get_lr()[0],
            loss_scale=self.loss_scale,
            grad_norm=self._global_grad_norm,
            comm_bytes=self.last_step_comm_bytes()["total"],
            skipped=not self._step_applied,
            moe=moe,
            stragglers=self.topology.stats.ledger.take_stragglers(),
        )
        if self.checkpoint_saver is not None:
            self.checkpoint_saver.check()  # a failed background save surfaces here
        if self.preemption is not None and self.preemption.auto:
            self._preemption_point()
        return True

    def _preemption_point(self) -> None:
        """Every rank together: when any was signalled, save to ``checkpoint.save_dir``
        and exit with code 75 (``meshtrain.engine.preemption``)."""
        save_dir = self.config.checkpoint.save_dir
        if save_dir is None:
            raise ConfigError(
                "checkpoint.save_on_preemption is true but checkpoint.save_dir is not set: "
                "set checkpoint.save_dir to the folder the pre-emption checkpoint goes to"
            )
        if not self.preemption.requested(self.topology.group("world")):
            return
        from meshtrain.engine.preemption import preempt

        path = self.save_checkpoint(save_dir)
        self.wait_for_checkpoint()
        raise preempt(self.global_steps, path, self.preemption.late_by)

    def _optimizer_step(self) -> None:
        adopt_rebound(self.zero.flat_groups)
        self.zero.before_step()
        unscale = self.zero.grad_scale  # loss scale x dp / f, less what was divided already
        # over every stage: clipping and overflow agree on all
        norm = self.scaled_grad_norm() if self._norm_once is None else self._norm_once
        clip = self.clip if self._clip_once is None else self._clip_once
        self._clip_once = self._norm_once = None
        overflow = not math.isfinite(norm)
        self._step_applied = not overflow
        if overflow:
            self._global_grad_norm = None
            self.skipped_steps += 1
        else:
            self._global_grad_norm = norm / unscale
            factor = 1.0 / unscale
            if clip > 0:
                factor *= min(1.0, clip / (self._global_grad_norm + 1e-6))
            self.zero.step(self.optimizer, factor)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.zero.after_step()
        self.scaler.update(overflow)
        self.global_steps += 1

    # state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's own state (JSON-able): step counters, loss scaler, LR scheduler and
        the training data loader's position. Model and optimizer tensors are the
        checkpoint's (``save_checkpoint``)."""
        loader = self.training_dataloader
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "scaler": self.scaler.state_dict(),
            "scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "data_loader": None if loader is None else loader.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], *, load_lr_scheduler: bool = True) -> None:
        """Restore what ``state_dict`` returned (a missing or None entry is left as is)."""
        for key in ("global_steps", "micro_steps", "skipped_steps"):
            if state.get(key) is not None:
                setattr(self, key, int(state[key]))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if load_lr_scheduler and self.lr_scheduler is not None and state.get("scheduler"):
            self.lr_scheduler.load_state_dict(state["scheduler"])
        if self.training_dataloader is not None and state.get("data_loader"):
            self.training_dataloader.load_state_dict(state["data_loader"])

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict (every parameter whole: gathered under ZeRO-3,
        unsharded and unpadded under tensor parallelism, every stage's under pipeline
        parallelism, in the unsplit model's names). Every rank must call it."""
        with self.gathered_parameters():  # ZeRO-3 (under pp: this rank's stages)
            if self.pipeline is not None:
                from meshtrain.engine.model_names import full_state_dict as whole_model

                return whole_model(self)
            if self.topology.tp_size > 1:
                from meshtrain.parallel.tensor.sharding import full_state_dict

                state = full_state_dict(self.module, self.topology.tp_group)
            else:
                state = self.module.state_dict()
            return {k: v.detach().clone() for k, v in state.items()}

    def gathered_parameters(self, module: nn.Module | None = None):
        """Under ZeRO-3, make ``module``'s parameters (default: all) whole for the block
        (evaluation, export, generation); they are freed again on exit. Changes made to
        them inside are not kept. A no-op for stages 0-2. Every rank must enter it."""
        return self.zero.gathered(module)

    def save_checkpoint(
        self,
        save_dir,
        tag: str | None = None,
        client_state: dict | None = None,
        *,
        on_commit=None,
    ):
        """Write a sharded checkpoint ``save_dir/tag`` (default ``global_step<N>``) and
        point ``save_dir/latest`` at it once every rank's files are complete. Every rank
        calls it; ``client_state`` (default ``{}``) must be JSON-able and comes back from
        ``load_checkpoint``. Returns the checkpoint directory (DeepSpeed returns True).

        With ``checkpoint.async_save`` it returns once this rank's state is copied to host
        memory; the directory exists when the background write commits
        (``wait_for_checkpoint``). ``on_commit(path)``: run on every rank after the commit
        (files to add beside the checkpoint)."""
        from meshtrain.engine.checkpoint_save import save

        adopt_rebound(self.zero.flat_groups)
        return save(self, save_dir, tag, {} if client_state is None else client_state, on_commit)

    def async_saver(self):
        """The engine's background checkpoint writer (``checkpoint.async_save``)."""
        if self.checkpoint_saver is None:
            from meshtrain.checkpoint.async_save import AsyncSaver

            self.checkpoint_saver = AsyncSaver(self.topology.group("world"))
        return self.checkpoint_saver

    def wait_for_checkpoint(self):
        """Block until an asynchronous save is committed; raise its failure. Returns the
        last committed checkpoint's folder (None when no asynchronous save ran). Call it
        before ``destroy_process_group``."""
        return None if self.checkpoint_saver is None else self.checkpoint_saver.wait()

    def save_16bit_model(
        self,
        save_dir,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's export: the whole model's weights, in the dtype the model trains in
        (bf16/fp16 when enabled, else fp32), into ``save_dir/save_filename``: a
        ``.safetensors`` name writes safetensors from the ranks that hold each tensor (no
        rank holds the whole model: ``engine.pretrained_shards``), any other a
        ``torch.save`` state dict that rank 0 writes from the gathered weights
        (``torch.load(path, weights_only=True)`` reads it). Whole under every ZeRO stage,
        TP and pipeline layout, whatever ``stage3_gather_16bit_weights_on_model_save`` says
        (DeepSpeed writes nothing useful under ZeRO-3 without it). Every rank must call it.
        Returns True."""
        from pathlib import Path

        if save_filename.endswith(".safetensors"):
            self.save_weights(
                save_dir, max_shard_size=None, exclude_frozen=exclude_frozen_parameters,
                aliases=True, single_name=save_filename,
            )  # fmt: skip
            return True
        state = self.module_state_dict()  # collective
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if self.topology.rank == 0:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        if self.topology.world_size > 1:
            import torch.distributed as dist

            dist.barrier()  # the file is complete when any rank returns
        return True

    def save_weights(
        self,
        save_dir,
        max_shard_size: int | str | None = "50GB",
        *,
        dtype: torch.dtype | None = None,
        exclude_frozen: bool = False,
        aliases: bool | None = None,
        single_name: str = "model.safetensors",
        index_parameters: bool = True,
    ):
        """The model's weights as ``save_pretrained`` writes them (``model.safetensors``, or
        ``model-0000K-of-0000N.safetensors`` cut at ``max_shard_size`` plus
        ``model.safetensors.index.json``), each file written by the rank holding most of
        it from the ranks' own shards: no rank ever holds the whole model. ``dtype``: cast
        floating tensors (default: the model's own). ``aliases``: keep tied names as copies
        (default: only when the model is not a transformers model that re-ties them).
        ``index_parameters``: the index counts elements too, as transformers' does. Every
        rank must call it. Returns what was written (``SavedWeights``)."""
        from meshtrain.engine.pretrained_shards import save_pretrained_shards

        adopt_rebound(self.zero.flat_groups)  # the files are cut from ZeRO's flat storage
        with self.between_steps():  # its bytes and time are not the next step's
            return save_pretrained_shards(
                self, save_dir, max_shard_size=max_shard_size, dtype=dtype, aliases=aliases,
                exclude_frozen=exclude_frozen, single_name=single_name,
                index_parameters=index_parameters,
            )  # fmt: skip

    def load_checkpoint(
        self,
        load_dir,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ):
        """Load ``load_dir/tag`` (default: the tag ``latest`` names), written under any
        data-parallel, tensor- or pipeline-parallel size or ZeRO stage. Returns
        ``(load_path, client_state)``, or ``(None, None)`` with a logged warning when there
        is nothing to load (no such directory, an empty one, or no such tag), as DeepSpeed
        does."""
        from meshtrain.engine.checkpoint_load import load

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

    # -- queries, under DeepSpeed's names and meanings: read-only views of the state above
    def get_lr(self) -> list[float]:
        """The current learning rate of each optimizer param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one data-parallel rank."""
        return self.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.gas

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks (micro x accumulation x dp)."""
        return self.micro_batch_size * self.gas * self.topology.dp_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3) the engine runs."""
        return self.zero_stage

    def fp16_enabled(self) -> bool:
        """True when the model runs in float16 with loss scaling."""
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        """True when the model runs in bfloat16."""
        return self.config.precision == "bf16"

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the world (``dp_world_size`` counts data-parallel ranks)."""
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        """Number of data-parallel ranks (equal to ``world_size`` without TP/PP)."""
        return self.topology.dp_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK`` / ``SLURM_LOCALID``; 0 alone)."""
        return read_env().local_rank

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm of the last step before clipping (None if it overflowed)."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (False after a skip)."""
        return self._step_applied

    @property
    def last_step_skipped(self) -> bool:
        return not self._step_applied

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

    def last_step_comm_by_group(self) -> dict[tuple[str, str], int]:
        """Bytes the last optimizer step recorded, by (op kind or label, group name)."""
        return dict(self._step_comm)


def _counted(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What the step log counts samples and tokens in: a lone batch dict or tuple is
    looked into (the model still gets it whole)."""
    if len(args) == 1 and not kwargs:
        if isinstance(args[0], dict):
            return (), args[0]
        if isinstance(args[0], list | tuple):
            return tuple(args[0]), {}
    return args, kwargs


__all__ = ["Engine"]
