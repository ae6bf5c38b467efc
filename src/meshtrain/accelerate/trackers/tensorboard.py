"""accelerate's ``TensorBoardTracker``, written the way accelerate writes it.

Events go to ``<logging_dir>/<project_name>/`` (``SummaryWriter`` from
``torch.utils.tensorboard``, which needs the ``tensorboard`` package). ``log`` writes a
number as a scalar, a string as text and a dict of numbers as ``add_scalars``, then
flushes. ``store_init_configuration`` writes the config as hyperparameters
(``add_hparams``, which TensorBoard files under a sub-run named by the time) and as
``<time>/hparams.yml`` beside it, as accelerate does.
"""

from __future__ import annotations

import os
import time
from typing import Any


class TensorBoardTracker:
    """One TensorBoard run on the main process (module docstring)."""

    name = "tensorboard"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_name = run_name
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import yaml

        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w") as f:
            yaml.dump(values, f)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, int | float):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


__all__ = ["TensorBoardTracker"]
