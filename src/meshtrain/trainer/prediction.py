"""Evaluation and prediction of the Trainer: ``evaluate``, ``predict``,
``prediction_step`` and ``get_eval_dataloader`` with transformers' signatures. A part of
the :class:`~meshtrain.trainer.Trainer` class (a mixin, so the class reads in two files
of one job each); the gathering over ranks is ``trainer.evaluation``'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.models.kv_cache import CACHE_NAMES
from meshtrain.trainer import evaluation as ev
from meshtrain.trainer.state import PredictionOutput


class Prediction:
    """``evaluate`` / ``predict`` / ``prediction_step`` of the Trainer."""

    def get_eval_dataloader(self, eval_dataset: Any = None):
        """The batches this rank evaluates (its rows of the dataset; ``evaluate``'s)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigError("Trainer.get_eval_dataloader() needs eval_dataset=")
        self._setup()
        dataset = self._prepare_dataset(dataset)
        return ev.eval_loader(dataset, self.args, self.topology, self.data_collator)

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
        out = self._prediction_loop(dataset, ignore_keys, metric_key_prefix)
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
        out = self._prediction_loop(test_dataset, ignore_keys, metric_key_prefix)
        self.control = self._event("on_predict", metrics=out.metrics)
        return out

    def _prediction_loop(self, dataset: Any, ignore_keys: list[str] | None, prefix: str):
        self._setup()
        dataset = self._prepare_dataset(dataset)
        hooks = ev.PredictionHooks(self._eval_steps, self._on_prediction_step, self._pad_forward)
        return ev.prediction_loop(self, dataset, ignore_keys, prefix, hooks)

    def _eval_steps(self, loader, loss_only: bool, ignore_keys: list[str] | None):
        if self._pipeline is not None and not self._whole_model:  # several forwards at once
            steps = self._pipeline.prediction_steps(loader, loss_only, ignore_keys)
            gather = self._gather_vocab  # pp x tp: the last stage's logits are vocab shards
            if gather is None:
                return steps
            return ((b, loss, gather(lg), lab) for b, loss, lg, lab in steps)
        return (
            (b, *self.prediction_step(self.model, self._prepare_inputs(b), loss_only, ignore_keys))
            for b in loader
        )

    def _on_prediction_step(self) -> None:
        self.control = self._event("on_prediction_step")

    def _pad_forward(self, batch: Any) -> None:
        self.prediction_step(self.model, self._prepare_inputs(batch), True, None)

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
                loss, outputs = self._call_compute_loss(model, inputs, True)
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


__all__ = ["Prediction"]
