"""Callbacks: the transformers ``TrainerCallback`` hooks, the flow rules that decide when to
log / evaluate / save, early stopping, and rank 0's console + files.

Every hook gets ``(args, state, control, **kwargs)`` with ``model``, ``engine``,
``optimizer``, ``lr_scheduler``, ``train_dataloader`` and, where they apply, ``logs`` or
``metrics``; a hook may return a ``TrainerControl`` to replace the current one (as in
transformers). Hooks run on every process; ``state.is_world_process_zero`` tells rank 0.

``RunLogCallback`` reuses ``meshtrain.trainer.run_log`` (the progress bar,
``metrics.jsonl``, TensorBoard and ``loss.png`` that ``meshtrain train`` writes), so both
ways of training show and write the same things.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.trainer.arguments import TrainingArguments
from meshtrain.trainer.state import ExportableState, TrainerControl, TrainerState

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
    "on_prediction_step",
)


class TrainerCallback:
    """Base class: override the hooks you need (all do nothing here)."""

    def _noop(self, args, state, control, **kwargs):
        return None

    on_init_end = on_train_begin = on_train_end = on_epoch_begin = on_epoch_end = _noop
    on_step_begin = on_pre_optimizer_step = on_optimizer_step = on_substep_end = _noop
    on_step_end = on_evaluate = on_predict = on_save = on_log = on_prediction_step = _noop


class CallbackHandler:
    """Calls one event on every callback in order; a returned control replaces the old."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks: list[Any] = []
        for cb in callbacks:
            self.add(cb)

    def add(self, callback: Any) -> None:
        cb = callback() if isinstance(callback, type) else callback
        self.callbacks.append(cb)

    def pop(self, callback: Any) -> Any:
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def call(self, event: str, args, state, control, **kwargs) -> TrainerControl:
        for cb in self.callbacks:
            hook = getattr(cb, event, None)
            if hook is None:
                continue
            result = hook(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control


def every(value: float, max_steps: int) -> int:
    """An interval in steps (a float < 1 is a fraction of ``max_steps``, as in transformers)."""
    if value < 1:
        return max(1, math.ceil(value * max_steps))
    return int(value)


class DefaultFlowCallback(TrainerCallback):
    """When to log, evaluate and save (transformers' rules)."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if (
            args.logging_strategy == "steps"
            and step % every(args.logging_steps, state.max_steps) == 0
        ):
            control.should_log = True
        if (
            args.eval_strategy == "steps"
            and step % every(args.eval_steps, state.max_steps) == 0
            and step >= args.eval_delay
        ):
            control.should_evaluate = True
        if args.save_strategy == "steps" and step % every(args.save_steps, state.max_steps) == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            # transformers 5: a step-based evaluation also runs at the last step when that
            # step is not already an evaluation step
            if (
                args.eval_strategy == "steps"
                and step % every(args.eval_steps, state.max_steps) != 0
                and step >= args.eval_delay
            ):
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and state.epoch >= args.eval_delay:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stop when ``metric_for_best_model`` has not improved by more than
    ``early_stopping_threshold`` for ``early_stopping_patience`` evaluations."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def state(self) -> dict:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }

    def on_train_begin(self, args: TrainingArguments, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ConfigError(
                "EarlyStoppingCallback needs TrainingArguments.metric_for_best_model "
                '(e.g. "loss" or a key compute_metrics returns)'
            )
        if args.eval_strategy == "no":
            raise ConfigError(
                'EarlyStoppingCallback needs evaluations: set eval_strategy to "steps" or "epoch"'
            )

    def on_evaluate(self, args: TrainingArguments, state, control, metrics=None, **kwargs):
        value = (metrics or {}).get(args.metric_key)
        if value is None:
            return
        better = state.best_metric is None or (
            value - state.best_metric > self.early_stopping_threshold
            if args.greater_is_better
            else state.best_metric - value > self.early_stopping_threshold
        )
        self.early_stopping_patience_counter = (
            0 if better else self.early_stopping_patience_counter + 1
        )
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True


def format_logs(logs: dict[str, Any]) -> str:
    """transformers' console line: ``{'loss': 0.6931, 'learning_rate': 4.9e-05, ...}``."""
    shown = {
        k: (round(v, 4) if isinstance(v, float) and abs(v) >= 1e-3 else v) for k, v in logs.items()
    }
    return str(shown)


class RunLogCallback(TrainerCallback):
    """Rank 0: the progress bar, log lines, ``metrics.jsonl``, TensorBoard, ``loss.png``."""

    def __init__(self, title: str = "meshtrain Trainer") -> None:
        self.title = title
        self.run_log = None
        self.start_step = 0
        self.rows: list[dict[str, Any]] = []  # this run's per-step rows (rank 0)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from meshtrain.trainer.run_log import RunLog

        tb = None
        if "tensorboard" in args.report_to:
            tb = Path(args.logging_dir or Path(args.output_dir) / "runs") / (args.run_name or "")
        self.start_step = state.global_step
        progress = None if args.disable_tqdm is None else not args.disable_tqdm
        self.run_log = RunLog(
            args.output_dir,
            start_step=state.global_step,
            max_steps=state.max_steps,
            tensorboard_dir=tb,
            progress=progress,
        ).__enter__()

    def on_step_end(self, args, state, control, engine=None, **kwargs):
        if self.run_log is not None and engine is not None and engine.log.last:
            self.run_log.step({**engine.log.last, "step": state.global_step})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.run_log is None or not logs:
            return
        self.run_log.write(format_logs(logs))
        evals = {
            k: v for k, v in logs.items() if k.startswith("eval_") and isinstance(v, int | float)
        }
        if evals:
            self.run_log.record(state.global_step, {**evals, "epoch": logs.get("epoch")})

    def on_train_end(self, args, state, control, **kwargs):
        if self.run_log is None:
            return
        from meshtrain.trainer.run_log import METRICS, PLOT, plot_loss

        self.run_log.__exit__(None, None, None)
        self.rows = [r for r in self.run_log.rows if "loss" in r]
        self.run_log = None
        out = Path(args.output_dir)
        plot_loss(out / METRICS, out / PLOT, self.title, self.start_step, ylabel="loss")


__all__ = [
    "EVENTS",
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "RunLogCallback",
    "TrainerCallback",
    "every",
    "format_logs",
]
