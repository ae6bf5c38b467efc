"""The Trainer resumed from a ``checkpoint-N/`` the transformers Trainer wrote.

The engine reads the folder through ``interop.trainer_source`` (weights, ``optimizer.pt``
mapped by transformers' parameter order, ``scheduler.pt``, step counters) into whatever
layout runs (each rank its own slice under ZeRO). What is the Trainer's:

* the ``TrainerState`` from ``trainer_state.json`` (a ``best_model_checkpoint`` that no
  longer exists is dropped, as transformers does);
* the data position, by transformers' rule (``Trainer._init_training_state``): with ``S``
  steps per epoch and ``g`` the saved ``global_step``, the run continues in epoch
  ``g // S`` after ``(g mod S) x gradient_accumulation_steps`` batches of each rank. Both
  Trainers draw the epoch's order from ``seed + epoch`` and hand each optimizer step the
  next ``per_device x accumulation x ranks`` positions of it, so the loader's global
  position is that many rows per step done: the same rows come next as in the
  uninterrupted transformers run, at any rank count with the same global batch;
* the random streams, restored where transformers restores them (``_run_epoch``): before
  the epoch's iterator when no batch is skipped, else after the first window is fetched,
  so the loader's own draw happens on the same side of the restore.

``training_args.bin`` is never unpickled: one note says the run's own arguments apply.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import CheckpointError
from meshtrain.interop.trainer_source import ARGS, ARGS_NOTE, SCHEDULER, TrainerSource
from meshtrain.trainer.state import TrainerState


class RngRestore:
    """Sets the saved random streams once, at the point the loop calls it."""

    def __init__(self, source: TrainerSource, rank: int, world_size: int, say) -> None:
        self.source, self.rank, self.world_size, self.say = source, rank, world_size, say
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        note = self.source.restore_rng(self.rank, self.world_size)
        if note is not None:
            self.say(note)


def resume_from_transformers(
    engine: Any,
    loader: Any,
    path: Path,
    *,
    steps_per_epoch: int,
    per_device: int,
    gas: int,
    topology: Any,
    say: Callable[[str], None],
) -> tuple[TrainerState, RngRestore, bool]:
    """Load ``path`` into ``engine`` and place ``loader``; returns the resumed state, the
    RNG restore to call at transformers' point, and whether batches are skipped (module
    docstring)."""
    schedule = engine.lr_scheduler
    if schedule is not None and not isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
        raise CheckpointError(
            f"{path / SCHEDULER}: holds a torch LambdaLR's state (transformers' "
            f"lr_scheduler_type), which this run's {type(schedule).__name__} (the deepspeed= "
            "config's scheduler) cannot take; drop that scheduler section so the Trainer "
            "builds lr_scheduler_type's schedule"
        )
    with TrainerSource(path) as source:
        engine.load_checkpoint(source)
    if (path / ARGS).is_file():
        say(ARGS_NOTE.format(path=path))
    state = TrainerState.from_dict(source.trainer_state)
    if state.best_model_checkpoint and not os.path.isdir(state.best_model_checkpoint):
        state.best_model_checkpoint = None
    dp = topology.dp_size
    epochs, steps_in = divmod(state.global_step, steps_per_epoch)
    position = loader.state_dict()
    rows = len(loader.dataset)
    position.update(epoch=epochs, consumed=min(rows, steps_in * gas * per_device * dp))
    loader.load_state_dict(position)
    writers = source.writer_world_size
    saved_batch = source.trainer_state.get("train_batch_size")
    if writers and saved_batch and saved_batch * writers != per_device * dp:
        say(
            f"{path}: saved by {writers} process(es) of batch {saved_batch}; this run has "
            f"{dp} of {per_device}: the data position counts this run's batches "
            "(transformers' rule), so other rows follow than in the saved run"
        )
    restore = RngRestore(source, topology.rank, topology.world_size, say)
    return state, restore, steps_in > 0


__all__ = ["RngRestore", "resume_from_transformers"]
