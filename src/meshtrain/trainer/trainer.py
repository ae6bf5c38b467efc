"""``Trainer``: transformers' training loop API on meshtrain's engine.

``from meshtrain import Trainer, TrainingArguments`` runs a transformers Trainer script
unchanged on one process or many (``meshtrain launch``, torchrun, ``python script.py``,
``notebook_launcher``), under data parallelism or ZeRO 1-3 (``deepspeed=`` / ``mesh=``).

One optimizer step: fetch the ``gradient_accumulation_steps`` micro-batches of the
window, count their label items, all-reduce the count over the data-parallel ranks, then
forward / ``engine.backward`` / ``engine.step`` each with the loss weighted so the step
equals one big batch (``meshtrain.trainer.loss``). The data loader is meshtrain's
resumable distributed loader, so a checkpoint records the exact data position and
``resume_from_checkpoint`` continues with the next unseen batch. See docs/trainer.md.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from meshtrain.errors import ConfigError, TrainingError
from meshtrain.trainer import checkpoints as ckpt
from meshtrain.trainer import evaluation as ev
from meshtrain.trainer.arguments import TrainingArguments
from meshtrain.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    RunLogCallback,
    TrainerCallback,
)
from meshtrain.trainer.loss import (
    forward_names,
    label_items,
    loss_shifts_labels,
    takes_argument,
)
from meshtrain.trainer.report import end_table, training_header
from meshtrain.trainer.state import (
    PredictionOutput,
    TrainerControl,
    TrainerState,
    TrainOutput,
)


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (transformers' ``set_seed``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _default_collator(tokenizer: Any) -> Callable:
    if tokenizer is not None and hasattr(tokenizer, "pad"):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(tokenizer)

    def collate(features: list[Any]) -> Any:
        if features and isinstance(features[0], Mapping):
            from transformers import default_data_collator

            return default_data_collator(features)
        return torch.utils.data.default_collate(features)

    return collate


class Trainer:
    """Train, evaluate and predict with transformers' Trainer API on meshtrain's engine.

    Args follow transformers: ``model``, ``args`` (:class:`TrainingArguments`),
    ``data_collator``, ``train_dataset``, ``eval_dataset`` (a dataset or a dict of them),
    ``processing_class`` / ``tokenizer``, ``compute_metrics(EvalPrediction) -> dict``,
    ``callbacks``, ``optimizers=(optimizer, scheduler)``, ``compute_loss_func(outputs,
    labels, num_items_in_batch)``, ``preprocess_logits_for_metrics(logits, labels)``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.args = args if args is not None else TrainingArguments()
        set_seed(self.args.seed)
        if model is None:
            if model_init is None:
                raise ConfigError("Trainer: pass model= (or model_init=)")
            model = model_init()
        self.model = model
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self.tokenizer = self.processing_class
        self.data_collator = data_collator or _default_collator(self.processing_class)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.loss_is_scaled_for_ga: bool | None = None
        self._improved = False
        self._applied_lr = 0.0
        names = forward_names(model)
        found = [n for n in (names or ()) if "label" in n]
        self.label_names = self.args.label_names or found or ["labels"]
        self._forward_names = names
        self._shift = loss_shifts_labels(model)
        self.engine = None
        # where checkpoints go and how they are named (``meshtrain train`` uses its own)
        self.checkpoint_dir = self.args.output_dir
        self.checkpoint_prefix = ckpt.PREFIX
        self.start_step = 0
        self.state = TrainerState()
        self.control = TrainerControl()
        self.callback_handler = CallbackHandler(
            [DefaultFlowCallback(), RunLogCallback(), *(callbacks or [])]
        )
        self.control = self._event("on_init_end")

    # -- callbacks ------------------------------------------------------------------------
    def add_callback(self, callback: TrainerCallback | type) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback: TrainerCallback | type) -> Any:
        return self.callback_handler.pop(callback)

    def _event(self, name: str, **kwargs: Any) -> TrainerControl:
        return self.callback_handler.call(
            name,
            self.args,
            self.state,
            self.control,
            model=self.model,
            engine=self.engine,
            optimizer=None if self.engine is None else self.engine.optimizer,
            lr_scheduler=None if self.engine is None else self.engine.lr_scheduler,
            processing_class=self.processing_class,
            **kwargs,
        )

    # -- set-up ---------------------------------------------------------------------------
    def _prepare_dataset(self, dataset: Any) -> Any:
        """transformers' ``remove_unused_columns`` for ``datasets.Dataset``."""
        if not self.args.remove_unused_columns or not hasattr(dataset, "column_names"):
            return dataset
        if self._forward_names is None:
            return dataset
        keep = set(self._forward_names) | set(self.label_names) | {"label", "label_ids"}
        unused = [c for c in dataset.column_names if c not in keep]
        return dataset.remove_columns(unused) if unused else dataset

    def prepare_engine(self):
        """Process group, mesh, engine and training loader (once); returns the engine."""
        self._setup()
        return self.engine

    def _setup(self) -> None:
        if self.engine is not None:
            return
        import meshtrain
        from meshtrain.data.loader import ResumableDataLoader
        from meshtrain.distributed.env import init_distributed
        from meshtrain.distributed.topology import Topology

        args = self.args
        init_distributed()
        mesh = args.mesh or {}
        topology = Topology(
            pp=int(mesh.get("pipeline_parallel_size", 1)),
            tp=int(mesh.get("tensor_parallel_size", 1)),
        )
        self.topology = topology
        self.state.is_world_process_zero = topology.rank == 0
        self.state.is_local_process_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
        dp, gas = topology.dp_size, args.gradient_accumulation_steps
        loader = None
        if self.train_dataset is not None:
            self.train_dataset = self._prepare_dataset(self.train_dataset)
            loader = ResumableDataLoader(
                self.train_dataset,
                args.per_device_train_batch_size,
                num_replicas=dp,
                rank=topology.dp_rank,
                shuffle=True,
                seed=args.data_seed if args.data_seed is not None else args.seed,
                collate_fn=self.data_collator,
                drop_last=args.dataloader_drop_last,
                num_workers=args.dataloader_num_workers,
            )
            self.steps_per_epoch = max(1, math.ceil(len(loader) / gas))
        else:
            self.steps_per_epoch = 1
        if args.max_steps > 0:
            self.max_steps = args.max_steps
        else:
            self.max_steps = max(1, math.ceil(args.num_train_epochs * self.steps_per_epoch))
        self.num_epochs = math.ceil(self.max_steps / self.steps_per_epoch)
        config = args.to_engine_config(total_steps=self.max_steps)
        scheduler = self.lr_scheduler
        if scheduler is None and "scheduler" not in config:
            from meshtrain.trainer.schedules import scheduler_factory

            warmup = args.warmup_for(self.max_steps)
            scheduler = scheduler_factory(args.lr_scheduler_type, warmup, self.max_steps)
        self.num_parameters = sum(
            p.numel()
            for p in {id(p): p for p in self.model.parameters()}.values()
            if p.requires_grad
        )
        self.engine, _, _, _ = meshtrain.initialize(
            model=self.model,
            model_parameters=self._param_groups(),
            config=config,
            optimizer=self.optimizer,
            lr_scheduler=scheduler,
            topology=topology,
        )
        self.engine.training_dataloader = loader  # its position goes into checkpoints
        self.train_dataloader = loader
        self.optimizer = self.engine.optimizer
        self.lr_scheduler = self.engine.lr_scheduler

    def _param_groups(self) -> list[dict[str, Any]]:
        """transformers' weight-decay split: no decay for biases and normalisation weights."""
        decay, no_decay = [], []
        for module in self.model.modules():
            norm = (
                isinstance(module, nn.LayerNorm | nn.GroupNorm)
                or "norm" in type(module).__name__.lower()
            )
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                (no_decay if norm or name == "bias" else decay).append(p)
        # the decay group takes the optimizer's weight_decay (weight_decay, or the one a
        # deepspeed= config's optimizer section sets)
        groups: list[dict[str, Any]] = [{"params": decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return [g for g in groups if g["params"]]

    # -- one step -------------------------------------------------------------------------
    def _prepare_inputs(self, inputs: Any) -> Any:
        """Move a batch to the engine's device (floats to the training dtype)."""
        device, dtype = self.engine.device, self.engine.dtype

        def move(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                x = x.to(device, non_blocking=True)
                return x.to(dtype) if x.is_floating_point() and dtype != torch.float32 else x
            if isinstance(x, Mapping):
                return (
                    type(x)({k: move(v) for k, v in x.items()})
                    if isinstance(x, dict)
                    else {k: move(v) for k, v in x.items()}
                )
            if isinstance(x, list | tuple):
                return type(x)(move(v) for v in x)
            return x

        return move(inputs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ):
        """The model's loss on ``inputs`` (a mean over the batch's label items).

        A model whose ``forward`` does not take the labels gets the inputs without them;
        its loss then comes from ``compute_loss_func``, or from an output named ``loss``.
        """
        inputs = dict(inputs)
        labels = None
        names = self._forward_names
        if names is not None or self.compute_loss_func is not None:
            wanted = [n for n in self.label_names if n in inputs]
            if self.compute_loss_func is not None or any(n not in names for n in wanted):
                labels = inputs.pop(wanted[0]) if wanted else None
                for n in wanted[1:]:
                    inputs.pop(n)
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif isinstance(outputs, Mapping) and outputs.get("loss") is not None:
            loss = outputs["loss"]
        elif isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
            loss = outputs  # a model that returns its loss (meshtrain's Decoder, ...)
        elif isinstance(outputs, tuple | list) and any(n in inputs for n in self.label_names):
            loss = outputs[0]  # return_dict=False: the loss comes first
        else:
            raise TrainingError(
                f"{type(model).__name__} returned no loss for a batch with keys "
                f"{sorted(inputs)}: give it labels it accepts ({self.label_names}), pass "
                "compute_loss_func=, or override Trainer.compute_loss"
            )
        return (loss, outputs) if return_outputs else loss

    def _call_compute_loss(self, inputs: Any, return_outputs: bool, num_items: Any = None):
        """Call ``compute_loss`` with the new signature, or the old one (no
        ``num_items_in_batch``) that seed scripts override it with."""
        fn = self.compute_loss
        if takes_argument(fn, "num_items_in_batch"):
            return fn(
                self.model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items
            )
        return fn(self.model, inputs, return_outputs=return_outputs)

    def _loss_is_share(self) -> bool:
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return self.compute_loss_func is not None

    def training_step(self, window: list[Any]) -> tuple[torch.Tensor, float, float]:
        """One optimizer step over the micro-batches of ``window``; returns (this rank's
        share of the step's loss, this rank's summed item loss, its item count)."""
        from meshtrain.distributed import comm

        engine, gas, dp = self.engine, self.args.gradient_accumulation_steps, self.topology.dp_size
        counts = [label_items(b, self.label_names, self._shift) for b in window]
        total = torch.tensor(float(sum(counts)), device=engine.device)
        comm.all_reduce(total, self.topology.dp_group, label="control")
        total_items = float(total)
        if (
            len(window) < gas
        ):  # the epoch's short last window: make its last micro-step the boundary
            engine.micro_steps += gas - len(window)
        share = torch.zeros((), device=engine.device)
        local_sum = 0.0
        self.model.train()
        for i, (batch, n) in enumerate(zip(window, counts, strict=True)):
            inputs = self._prepare_inputs(batch)
            if isinstance(inputs, Mapping):  # samples/s and tokens/s of the engine's step log
                engine.log.count_batch((), inputs)
            num_items = torch.tensor(total_items, device=engine.device)
            loss = self._call_compute_loss(inputs, False, num_items)
            if isinstance(loss, tuple | list):
                loss = loss[0]
            if self._loss_is_share():
                part = loss
            else:
                part = loss * (n / total_items) if total_items else loss * 0.0
            engine.backward(part * (gas * dp))
            if i == len(window) - 1:
                self.control = self._event("on_pre_optimizer_step")
                self._applied_lr = engine.get_lr()[0]  # what this step uses (logged as such)
            engine.step()
            if i < len(window) - 1:
                self.control = self._event("on_substep_end")
            share += part.detach().float()
            local_sum += float(loss.detach()) * n if not self._loss_is_share() else 0.0
        self.control = self._event("on_optimizer_step")
        return share, local_sum, float(sum(counts))

    # -- training -------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: bool | str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train to ``max_steps`` / ``num_train_epochs``; see the module docstring."""
        if self.train_dataset is None:
            raise ConfigError("Trainer.train() needs train_dataset=")
        from meshtrain.distributed import comm

        args = self.args
        self._setup()
        engine, loader = self.engine, self.train_dataloader
        resume = resume_from_checkpoint
        if resume is None:
            resume = args.resume_from_checkpoint
        path = ckpt.resolve_resume(resume, self.checkpoint_dir, self.checkpoint_prefix)
        epoch_done = False
        if path is not None:
            _, client = engine.load_checkpoint(str(path.parent), tag=path.name)
            self.state = TrainerState.from_dict(client.get("trainer_state", {}))
            epoch_done = bool(client.get("epoch_done"))
            self._say(f"resuming from {path} (step {self.state.global_step})")
        st = self.state
        st.max_steps, st.num_train_epochs = self.max_steps, self.num_epochs
        st.logging_steps, st.eval_steps, st.save_steps = (
            args.logging_steps,
            args.eval_steps,
            args.save_steps,
        )
        st.train_batch_size = args.per_device_train_batch_size
        st.is_world_process_zero = self.topology.rank == 0
        start_step = self.start_step = st.global_step
        self._say(
            training_header(
                num_examples=len(self.train_dataset),
                num_epochs=self.num_epochs,
                per_device=args.per_device_train_batch_size,
                total_batch=engine.config.train_batch_size,
                accumulation=args.gradient_accumulation_steps,
                max_steps=self.max_steps,
                num_params=self.num_parameters,
                processes=self.topology.world_size,
                zero_stage=engine.zero_stage,
                precision=engine.config.precision,
            )
        )
        self.control = TrainerControl()
        self.control = self._event("on_train_begin")
        t0 = time.perf_counter()
        run_loss = torch.zeros((), device=engine.device)  # this run's summed step shares
        log_loss = torch.zeros((), device=engine.device)
        log_steps, self._last_eval = 0, None
        sampler = loader.sampler
        start_epoch = int(sampler.epoch) if path is not None else 0
        if path is not None and epoch_done and sampler.consumed >= len(self.train_dataset):
            start_epoch += 1
        n_rows = len(self.train_dataset)
        for epoch in range(start_epoch, self.num_epochs):
            if st.global_step >= self.max_steps or self.control.should_training_stop:
                break
            loader.set_epoch(epoch)
            batches = iter(loader)
            self.control = self._event("on_epoch_begin")
            while st.global_step < self.max_steps:
                window = list(itertools.islice(batches, args.gradient_accumulation_steps))
                if not window:
                    break
                self.control = self._event("on_step_begin")
                share, local_sum, local_items = self.training_step(window)
                if engine.log.last and local_items and not self._loss_is_share():
                    engine.log.last["loss"] = local_sum / local_items  # rank 0's item mean
                run_loss += share
                log_loss += share
                log_steps += 1
                st.global_step += 1
                st.epoch = epoch + min(1.0, sampler.consumed / max(1, n_rows))
                self.control = self._event("on_step_end")
                if self.control.should_log and log_steps:
                    comm.all_reduce(log_loss, self.topology.dp_group, label="control")
                    self._log_train(float(log_loss) / log_steps)
                    log_loss.zero_()
                    log_steps = 0
                self._evaluate_and_save(ignore_keys_for_eval, epoch_done=False)
                if self.control.should_training_stop or self.control.should_epoch_stop:
                    break
            self.control.should_epoch_stop = False
            if st.global_step >= self.max_steps or self.control.should_training_stop:
                if sampler.consumed < n_rows:
                    break
            st.epoch = float(epoch + 1)
            self.control = self._event("on_epoch_end")
            if self.control.should_log and log_steps:
                comm.all_reduce(log_loss, self.topology.dp_group, label="control")
                self._log_train(float(log_loss) / log_steps)
                log_loss.zero_()
                log_steps = 0
            self._evaluate_and_save(ignore_keys_for_eval, epoch_done=True)
        return self._finish_training(run_loss, start_step, t0)

    def _log_train(self, loss: float) -> None:
        grad_norm = self.engine.get_global_grad_norm()
        self.log(
            {
                "loss": loss,
                "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                "learning_rate": self._applied_lr,
            }
        )

    def _evaluate_and_save(self, ignore_keys: list[str] | None, epoch_done: bool) -> None:
        metrics = None
        if self.control.should_evaluate:
            metrics = self.evaluate(ignore_keys=ignore_keys)
            self._update_best(metrics)
            self.control.should_evaluate = False
        if self.control.should_save or (
            self.args.save_strategy == "best" and metrics is not None and self._improved
        ):
            if self.args.save_strategy != "best" or (metrics is not None and self._improved):
                self._save_checkpoint(epoch_done)
            self.control.should_save = False
        self.control.should_log = False

    def _update_best(self, metrics: dict[str, float]) -> None:
        self._improved = False
        key = self.args.metric_key
        if key is None:
            return
        if key not in metrics:
            raise ConfigError(
                f"TrainingArguments.metric_for_best_model={self.args.metric_for_best_model!r}: "
                f"the evaluation returned no {key!r}; available: {sorted(metrics)}. Use one of "
                "those names (without the eval_ prefix) or return it from compute_metrics"
            )
        value = float(metrics[key])
        if ckpt.is_better(value, self.state.best_metric, bool(self.args.greater_is_better)):
            self.state.best_metric = value
            self.state.best_global_step = self.state.global_step
            self._improved = True

    def _save_checkpoint(self, epoch_done: bool) -> None:
        """``output_dir/checkpoint-<step>`` (see ``meshtrain.trainer.checkpoints``)."""
        st, args, engine = self.state, self.args, self.engine
        root, prefix = self.checkpoint_dir, self.checkpoint_prefix
        tag = f"{prefix}{st.global_step}"
        if st.best_global_step == st.global_step:
            st.best_model_checkpoint = os.path.join(root, tag)
        client = {"trainer_state": st.to_dict(), "epoch_done": epoch_done}
        path = engine.save_checkpoint(root, tag=tag, client_state=client)
        export = hasattr(self.model, "save_pretrained")
        state_dict = engine.module_state_dict() if export else None  # every rank gathers
        if self.topology.rank == 0:
            if export:
                self.model.save_pretrained(path, state_dict=state_dict)
                if self.processing_class is not None and hasattr(
                    self.processing_class, "save_pretrained"
                ):
                    self.processing_class.save_pretrained(path)
            st.save_to_json(path / "trainer_state.json")
            best = ckpt.step_of(st.best_model_checkpoint, prefix)
            steps = ckpt.checkpoint_steps(root, prefix)
            ckpt.delete(root, ckpt.to_delete(steps, args.save_total_limit, best), prefix)
        self._barrier()
        self.control = self._event("on_save")

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and self.topology.world_size > 1:
            dist.barrier()

    def _finish_training(self, run_loss: torch.Tensor, start_step: int, t0: float) -> TrainOutput:
        from meshtrain.distributed import comm

        st, args = self.state, self.args
        comm.all_reduce(run_loss, self.topology.dp_group, label="control")
        steps = max(1, st.global_step - start_step)
        train_loss = float(run_loss) / steps
        if args.load_best_model_at_end and st.best_model_checkpoint:
            best = ckpt.resolve_resume(st.best_model_checkpoint, self.checkpoint_dir)
            if best is not None and best.is_dir():
                self._say(f"Loading best model from {best} (score: {st.best_metric}).")
                self.engine.load_checkpoint(str(best.parent), tag=best.name, load_module_only=True)
        self._sync_user_model()
        runtime = time.perf_counter() - t0
        samples = steps * self.engine.config.train_batch_size
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(samples / runtime, 3),
            "train_steps_per_second": round(steps / runtime, 3),
            "total_flos": 0.0,
            "train_loss": train_loss,
        }
        self.log(dict(metrics))
        self.control = self._event("on_train_end")
        logger = next(
            (c for c in self.callback_handler.callbacks if isinstance(c, RunLogCallback)), None
        )
        self.run_log_rows = [] if logger is None else logger.rows
        table = end_table(st.log_history)
        if table:
            self._say(table)
        return TrainOutput(st.global_step, train_loss, metrics)

    def _sync_user_model(self) -> None:
        """Under ZeRO-3 the model's parameters are shards between steps: give the user's
        model object the whole trained weights on every rank (hooks removed)."""
        engine = self.engine
        gatherer = getattr(engine.zero, "gatherer", None)
        if gatherer is None:
            return  # stages 0-2: every rank's module already holds the full weights
        state = engine.module_state_dict()
        gatherer.remove()
        engine.zero.gatherer = None
        with torch.no_grad():
            for name, p in engine.module.named_parameters():
                p.data = state[name].to(p.device)

    # -- logging --------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if getattr(self, "topology", None) is None or self.topology.rank == 0:
            print(text, flush=True)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``logs`` (with epoch and step) to ``state.log_history``; calls ``on_log``."""
        logs = dict(logs)
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self._event("on_log", logs=logs)

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` on ``eval_dataset``; keys start with ``eval_``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigError("Trainer.evaluate() needs eval_dataset= (here or in the Trainer)")
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        out = ev.prediction_loop(self, dataset, ignore_keys, metric_key_prefix)
        self.log(out.metrics)
        self.control = self._event("on_evaluate", metrics=out.metrics)
        return out.metrics

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        """Predictions for exactly the rows of ``test_dataset``, in order, on every rank."""
        out = ev.prediction_loop(self, test_dataset, ignore_keys, metric_key_prefix)
        self.control = self._event("on_predict", metrics=out.metrics)
        return out

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """(loss, logits, labels) of one batch; the loss goes through ``compute_loss``
        whenever the batch has labels, so custom losses and label-less forwards work."""
        has_labels = isinstance(inputs, Mapping) and all(
            inputs.get(n) is not None for n in self.label_names
        )
        with torch.no_grad():
            if has_labels:
                loss, outputs = self._call_compute_loss(inputs, True)
                loss = loss.detach().float().mean()
            else:
                loss, outputs = None, model(**inputs)
        if prediction_loss_only:
            return loss, None, None
        logits = ev.logits_of(outputs, ignore_keys or [])
        labels = None
        if has_labels:
            found = tuple(inputs[n] for n in self.label_names)
            labels = found[0] if len(found) == 1 else found
        return loss, logits, labels


__all__ = ["Trainer", "set_seed"]
