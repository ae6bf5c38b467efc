"""What a ``compute_loss`` / ``prediction_step`` override is handed as ``model`` under
pipeline parallelism (``trainer.pipeline_step``).

On the rank holding the last stage, per micro-batch, the pipeline has already run the
model on the batch: the first stage took the inputs, the last returned the model's whole
outputs (logits, and the model's own loss when the batch has labels it accepts). The
override then runs there with ``model`` this stand-in: calling it, with any arguments,
returns those outputs; every attribute (``config``, ``training``, a custom method) is the
user's model's. So ``outputs = model(inputs["x"])`` or ``model(**inputs)`` in an
override reads the pipeline's outputs, and the loss it returns is the micro-batch's.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class StageOutputs:
    """``model`` for a Trainer override on the last stage: returns ``outputs`` when called
    (the arguments are not run again: the pipeline ran them from the same batch); other
    attributes are ``model``'s."""

    def __init__(self, model: nn.Module, outputs: Any) -> None:
        self.model = model
        self.outputs = outputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.outputs

    def __getattr__(self, name: str) -> Any:  # only for names not set in __init__
        return getattr(self.model, name)


__all__ = ["StageOutputs"]
