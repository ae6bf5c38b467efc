"""Evaluation and prediction of the Trainer: ``evaluate``, ``predict`` and
``get_eval_dataloader`` with transformers' signatures (``Evaluator``, which the Trainer
builds and holds as ``trainer.evaluator``); the gathering over ranks is
``trainer.evaluation``'s.

The Evaluator holds the Trainer and calls back through it for every step a user may
override: each batch goes through ``trainer.prediction_step`` (which runs
``compute_loss``), a dict of eval datasets through ``trainer.evaluate`` per dataset, the
metrics through ``trainer.log``, so a subclass's methods run exactly as they would in
transformers' own Trainer."""

from __future__ import annotations

from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.trainer import evaluation as ev
from meshtrain.trainer.state import PredictionOutput


class Evaluator:
    """``evaluate`` / ``predict`` / ``get_eval_dataloader`` for one Trainer (module
    docstring); it reads the Trainer's public members (``args``, ``eval_dataset``,
    ``topology``, ``model``, ``pp_steps``, ``gather_vocab``,
    ``evaluate_whole_model``) when it runs, after set-up built them."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def get_eval_dataloader(self, eval_dataset: Any = None):
        """The batches this rank evaluates (its rows of the dataset; ``evaluate``'s)."""
        trainer = self.trainer
        dataset = eval_dataset if eval_dataset is not None else trainer.eval_dataset
        if dataset is None:
            raise ConfigError("Trainer.get_eval_dataloader() needs eval_dataset=")
        trainer.prepare_engine()
        dataset = trainer.prepare_dataset(dataset)
        return ev.eval_loader(dataset, trainer.args, trainer.topology, trainer.data_collator)

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` on ``eval_dataset``; keys start with ``eval_``."""
        trainer = self.trainer
        dataset = eval_dataset if eval_dataset is not None else trainer.eval_dataset
        if dataset is None:
            raise ConfigError("Trainer.evaluate() needs eval_dataset= (here or in the Trainer)")
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, ds in dataset.items():  # through the Trainer: an override runs per set
                metrics.update(trainer.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        out = self.prediction_loop(dataset, ignore_keys, metric_key_prefix)
        trainer.log(out.metrics)
        trainer.fire_event("on_evaluate", metrics=out.metrics)
        return out.metrics

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        """Predictions for exactly the rows of ``test_dataset``, in order, on every rank."""
        out = self.prediction_loop(test_dataset, ignore_keys, metric_key_prefix)
        self.trainer.fire_event("on_predict", metrics=out.metrics)
        return out

    def prediction_loop(self, dataset: Any, ignore_keys: list[str] | None, prefix: str):
        """``evaluation.prediction_loop`` over ``dataset`` with this Trainer's steps."""
        trainer = self.trainer
        trainer.prepare_engine()
        dataset = trainer.prepare_dataset(dataset)
        hooks = ev.PredictionHooks(self._steps, self._on_step, self._pad_forward)
        return ev.prediction_loop(trainer, dataset, ignore_keys, prefix, hooks)

    def _steps(self, loader, loss_only: bool, ignore_keys: list[str] | None):
        trainer = self.trainer
        pipeline = trainer.pp_steps
        if pipeline is not None and not trainer.evaluate_whole_model:  # several at once
            steps = pipeline.prediction_steps(loader, loss_only, ignore_keys)
            gather = trainer.gather_vocab  # pp x tp: the last stage's logits are vocab shards
            if gather is None:
                return steps
            return ((b, loss, gather(lg), lab) for b, loss, lg, lab in steps)
        return (
            (
                b,
                *trainer.prediction_step(
                    trainer.model, trainer.prepare_inputs(b), loss_only, ignore_keys
                ),
            )
            for b in loader
        )

    def _on_step(self) -> None:
        self.trainer.fire_event("on_prediction_step")

    def _pad_forward(self, batch: Any) -> None:
        trainer = self.trainer
        trainer.prediction_step(trainer.model, trainer.prepare_inputs(batch), True, None)


__all__ = ["Evaluator"]
