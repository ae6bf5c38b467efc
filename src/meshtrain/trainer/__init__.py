"""The transformers-style Trainer on meshtrain's engine: ``TrainingArguments`` (arguments),
``Trainer`` (trainer), callbacks (callbacks), checkpoint naming/rotation (checkpoints),
loss weighting (loss), gathering of predictions (evaluation). See docs/trainer.md."""

from __future__ import annotations

from meshtrain.trainer.arguments import TrainingArguments
from meshtrain.trainer.callbacks import EarlyStoppingCallback, TrainerCallback
from meshtrain.trainer.state import (
    EvalPrediction,
    ExportableState,
    PredictionOutput,
    TrainerControl,
    TrainerState,
    TrainOutput,
)
from meshtrain.trainer.trainer import Trainer, set_seed

__all__ = [
    "EarlyStoppingCallback",
    "EvalPrediction",
    "ExportableState",
    "PredictionOutput",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "set_seed",
]
