"""What the Trainer knows about a run (``TrainerState``), what callbacks may ask of it
(``TrainerControl``), and what ``train`` / ``predict`` / ``compute_metrics`` receive or
return (``TrainOutput``, ``PredictionOutput``, ``EvalPrediction``) -- the transformers
names and fields, so callbacks and metric functions written for transformers work.

``TrainerState`` is saved in every checkpoint (inside its manifest, so it is committed
atomically with the weights) and as ``trainer_state.json`` beside it for people to read.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np


class EvalPrediction:
    """Predictions and labels of an evaluation, gathered over every process in dataset
    order; unpacks as ``predictions, label_ids = eval_pred`` like transformers'."""

    def __init__(
        self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None
    ) -> None:
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses

    def _items(self) -> tuple:
        extra = tuple(x for x in (self.inputs, self.losses) if x is not None)
        return (self.predictions, self.label_ids, *extra)

    def __iter__(self):
        return iter(self._items())

    def __getitem__(self, i: int) -> Any:
        return self._items()[i]

    def __len__(self) -> int:
        return len(self._items())


class TrainOutput(NamedTuple):
    """What ``Trainer.train()`` returns."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class PredictionOutput(NamedTuple):
    """What ``Trainer.predict()`` returns: exactly one row per dataset row."""

    predictions: np.ndarray | tuple
    label_ids: np.ndarray | tuple | None
    metrics: dict[str, float] | None


@dataclass
class TrainerState:
    """The run's counters, history and best checkpoint (transformers' field names)."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: float = 500
    eval_steps: float | None = 500
    save_steps: float = 500
    train_batch_size: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    total_flos: float = 0.0
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    # transformers' fields that meshtrain never changes (no token counting unless asked,
    # no hyper-parameter search): kept so trainer_state.json has the peer's keys
    num_input_tokens_seen: int = 0
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """``logging_steps`` / ``eval_steps`` / ``save_steps`` in steps: a value below 1
        is a fraction of ``max_steps``, rounded up (transformers' rule)."""
        import math

        for name in ("logging", "eval", "save"):
            value = getattr(args, f"{name}_steps")
            if value is None:  # unset: the state keeps its default, as in transformers
                continue
            if value < 1:
                value = math.ceil(max_steps * value)
            setattr(self, f"{name}_steps", value)

    @classmethod
    def load_from_json(cls, path: str | Path) -> TrainerState:
        from meshtrain.errors import CheckpointError
        from meshtrain.files.structured import load_json

        fix = "resume from another checkpoint, or start without resume_from_checkpoint"
        data = load_json(path, CheckpointError, what="trainer state", fix=fix, empty_fix=fix)
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: the trainer state is not a JSON object; {fix}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save_to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=float) + "\n")


class ExportableState:
    """An object whose state travels in checkpoints (transformers' ``ExportableState``):
    ``state()`` returns ``{"args": ..., "attributes": ...}`` (JSON values), and
    ``from_state`` rebuilds it as ``cls(**args)`` with the attributes set. Saved in
    ``TrainerState.stateful_callbacks`` under the class name (a list for several
    instances); restored on resume when ``restore_callback_states_from_checkpoint``."""

    def state(self) -> dict:
        raise NotImplementedError("ExportableState subclasses implement state()")

    @classmethod
    def from_state(cls, state: dict):
        instance = cls(**state.get("args", {}))
        for key, value in state.get("attributes", {}).items():
            setattr(instance, key, value)
        return instance


def exported_states(objects: list[Any]) -> dict[str, Any]:
    """``stateful_callbacks`` for ``objects``: each ``ExportableState``'s ``state()`` by
    class name, a list where one class has several instances."""
    out: dict[str, Any] = {}
    for obj in objects:
        if not isinstance(obj, ExportableState):
            continue
        name = type(obj).__name__
        if name in out:
            out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [obj.state()]
        else:
            out[name] = obj.state()
    return out


@dataclass
class TrainerControl(ExportableState):
    """Flags callbacks set to steer the loop; the Trainer resets each after acting on it."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def state(self) -> dict:
        return {"args": dataclasses.asdict(self), "attributes": {}}


__all__ = [
    "EvalPrediction",
    "ExportableState",
    "PredictionOutput",
    "TrainOutput",
    "TrainerControl",
    "TrainerState",
    "exported_states",
]
