"""``Trainer``: transformers' training loop API on meshtrain's engine.

``from meshtrain import Trainer, TrainingArguments`` runs a transformers Trainer script
unchanged on one process or many (``meshtrain launch``, torchrun, ``python script.py``,
``notebook_launcher``), under data parallelism or ZeRO 1-3 (``deepspeed=`` / ``mesh=``),
tensor or pipeline parallelism (``trainer.pipeline_step``).

One optimizer step: fetch the ``gradient_accumulation_steps`` micro-batches of the
window, count their label items, all-reduce the count over the data-parallel ranks, then
forward / ``engine.backward`` / ``engine.step`` each with the loss weighted so the step
equals one big batch (``meshtrain.trainer.loss``). The data loader is meshtrain's
resumable distributed loader, so a checkpoint records the exact data position and
``resume_from_checkpoint`` continues with the next unseen batch. See docs/trainer.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from meshtrain.errors import ConfigError, TrainingError
from meshtrain.models.kv_cache import CACHE_NAMES
from meshtrain.trainer import checkpoints as ckpt
from meshtrain.trainer import evaluation as ev
from meshtrain.trainer import setup
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
from meshtrain.trainer.saving import ModelSaving
from meshtrain.trainer.state import (
    PredictionOutput,
    TrainerControl,
    TrainerState,
)
from meshtrain.trainer.training_loop import TrainingLoop


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (transformers' ``set_seed``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer(TrainingLoop, ModelSaving):
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
        self.data_collator = data_collator or setup.default_collator(self.processing_class)
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
        self._gather_vocab = None  # set by setup.build_engine under tensor parallelism
        self._new_signature: tuple[Any, bool] = (None, False)  # compute_loss's signature
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
        return setup.prepare_dataset(self, dataset)

    def prepare_engine(self):
        """Process group, mesh, engine and training loader (once); returns the engine."""
        setup.build_engine(self)
        return self.engine

    def _setup(self) -> None:
        setup.build_engine(self)

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
        key = getattr(fn, "__func__", fn)
        if self._new_signature[0] is not key:  # inspect once per override, not per step
            self._new_signature = (key, takes_argument(fn, "num_items_in_batch"))
        if self._new_signature[1]:
            return fn(
                self.model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items
            )
        return fn(self.model, inputs, return_outputs=return_outputs)

    def _loss_is_share(self) -> bool:
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return self.compute_loss_func is not None

    def _window_items(self, window: list[Any]) -> tuple[list[int], float, float]:
        """Label items per micro-batch of ``window``, their sum on this rank, and the sum
        over every data-parallel rank (one all-reduce of one number)."""
        counts = [label_items(b, self.label_names, self._shift) for b in window]
        local_items = float(sum(counts))
        total_items = local_items
        if self.topology.dp_size > 1:
            from meshtrain.distributed import comm

            total = torch.tensor(local_items, device=self.engine.device)
            comm.all_reduce(total, self.topology.dp_group, label="control")
            total_items = float(total)
        return counts, local_items, total_items

    def training_step(self, window: list[Any]) -> tuple[torch.Tensor, float, float]:
        """One optimizer step over the micro-batches of ``window``; returns (this rank's
        share of the step's loss, this rank's summed item loss, its item count)."""
        if self.engine.pipeline is not None:  # the window runs in the pipeline's schedule
            from meshtrain.trainer import pipeline_step

            return pipeline_step.training_step(self, window)
        engine, gas, dp = self.engine, self.args.gradient_accumulation_steps, self.topology.dp_size
        counts, local_items, total_items = self._window_items(window)
        engine.shorten_window(len(window))  # the epoch's short last window steps too
        num_items = torch.tensor(total_items, device=engine.device)
        is_share = self._loss_is_share()
        share = torch.zeros((), device=engine.device)
        local_sum = torch.zeros((), device=engine.device)  # read once: no sync per micro-batch
        if not self.model.training:  # after an evaluation (train() walks every module)
            self.model.train()
        last = len(window) - 1
        for i, (batch, n) in enumerate(zip(window, counts, strict=True)):
            inputs = self._prepare_inputs(batch)
            if isinstance(inputs, Mapping):  # samples/s and tokens/s of the engine's step log
                engine.log.count_batch((), inputs)
            loss = self._call_compute_loss(inputs, False, num_items)
            if isinstance(loss, tuple | list):
                loss = loss[0]
            # this micro-batch's share of the step (module docstring of trainer.loss), and
            # the engine's 1 / (gas * dp) undone, in one multiplication (none when it is 1)
            weight = 1.0 if is_share else (n / total_items if total_items else 0.0)
            factor = weight * gas * dp
            engine.backward(loss if factor == 1.0 else loss * factor)
            if i == last:
                self.control = self._event("on_pre_optimizer_step")
                self._applied_lr = engine.get_lr()[0]  # what this step uses (logged as such)
            engine.step()
            if i < last:
                self.control = self._event("on_substep_end")
            detached = loss.detach().float()
            share += detached if is_share else detached * weight
            if not is_share:
                local_sum += detached * n
        self.control = self._event("on_optimizer_step")
        return share, float(local_sum), local_items

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
        if self._gather_vocab is not None:  # tensor parallelism: whole-vocabulary logits
            outputs = self._gather_vocab(outputs)
        if ignore_keys is None:  # as transformers: e.g. a decoder's key/value cache
            config = getattr(self.model, "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", list(CACHE_NAMES))
        logits = ev.logits_of(outputs, ignore_keys)
        labels = None
        if has_labels:
            found = tuple(inputs[n] for n in self.label_names)
            labels = found[0] if len(found) == 1 else found
        return loss, logits, labels


__all__ = ["Trainer", "set_seed"]
