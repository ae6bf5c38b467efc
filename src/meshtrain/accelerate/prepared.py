"""What ``Accelerator.prepare`` hands back: thin objects that drive one meshtrain Engine.

========================  ==================================================================
object                    what its calls do
========================  ==================================================================
``PreparedModel``         ``model(x)`` / ``model(**batch)`` run ``engine.forward``; ``train``,
                          ``eval``; any other attribute is the user's module's
``PreparedOptimizer``     ``step()`` is ``engine.step()`` (it acts at the accumulation
                          boundary only); ``zero_grad()`` is a no-op: the engine clears the
                          flat gradient buffers after each optimizer step
``PreparedScheduler``     ``step()`` steps the user's scheduler once per *real* optimizer
                          step the engine applied since its last step (none inside an
                          accumulation window, none after a skipped fp16 step)
``PreparedDataLoader``    a :class:`~meshtrain.data.loader.ResumableDataLoader` dealing the
                          dataset over the data-parallel ranks; batches land on the device;
                          its position is saved by ``save_state`` and resumed exactly
========================  ==================================================================

Accelerate differences, on purpose: accelerate steps a scheduler ``num_processes`` times
per optimizer step (``split_batches=False``); here it steps once per optimizer step, the
schedule a single process would follow over the same global batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from meshtrain.data.loader import ResumableDataLoader


class PreparedModel:
    """The model as prepared: calling it runs the engine's forward (device placement,
    model dtype, ZeRO-3 gathering); attributes fall through to the user's module."""

    def __init__(self, engine) -> None:
        self.__dict__["engine"] = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> PreparedModel:
        self.engine.train(mode)
        return self

    def eval(self) -> PreparedModel:
        return self.train(False)

    def __getattr__(self, name: str) -> Any:  # parameters(), config, generate, ...
        return getattr(self.engine.module, name)

    def __repr__(self) -> str:
        return f"PreparedModel({self.engine.module.__class__.__name__}, zero_stage={self.engine.zero_stage})"


class PreparedOptimizer:
    """The user's optimizer, now stepping the engine's fp32 master chunks."""

    def __init__(self, accelerator, engine) -> None:
        self.accelerator = accelerator
        self.engine = engine
        self.optimizer = engine.optimizer
        self._stepped = False  # did the last step() end an accumulation window?

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None) -> None:
        """One micro-step of the engine; the parameters change at the window's end only."""
        if closure is not None:
            raise TypeError("PreparedOptimizer.step does not take a closure")
        self._stepped = self.accelerator._engine_step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """No-op: the engine zeroes its gradient buffers after every optimizer step, and
        inside an accumulation window the gradients must be kept."""

    @property
    def step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow)."""
        return self._stepped and not self.engine.was_step_applied()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer.__class__.__name__})"


class PreparedScheduler:
    """The user's LR scheduler, stepped once per optimizer step the engine applied."""

    def __init__(self, scheduler, engine) -> None:
        self.scheduler = scheduler
        self.engine = engine
        self._seen_steps = engine.global_steps - engine.skipped_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        applied = self.engine.global_steps - self.engine.skipped_steps
        for _ in range(applied - self._seen_steps):
            self.scheduler.step(*args, **kwargs)
        self._seen_steps = applied

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "seen_steps": self._seen_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self._seen_steps = int(state["seen_steps"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return type(x)({k: _to_device(v, device) for k, v in x.items()})
    if isinstance(x, list | tuple) and not hasattr(x, "_fields"):
        return type(x)(_to_device(v, device) for v in x)
    return x


class PreparedDataLoader(ResumableDataLoader):
    """A resumable, data-parallel loader built from the user's ``DataLoader``.

    Each rank gets ``batch_size`` samples per batch (the global batch is ``batch_size x
    num_processes``, as in accelerate). A pass that runs to its end moves to the next
    epoch (a new shuffle), so ``for epoch in ...: for batch in loader`` reshuffles as
    accelerate's loaders do. ``batch_rows()`` says which global slots the last batch held,
    which is what lets ``gather_for_metrics`` drop the sampler's padding exactly.
    """

    def __init__(self, dataset, batch_size: int, *, device: torch.device, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size, **kwargs)
        self.device = device
        self._pass_remaining = 0  # M: samples left in the dataset when this pass began
        self._local_start = 0  # this rank's position in the pass before the last batch
        self._last_rows = 0  # rows in the last batch
        self.end_of_dataloader = False
        self.batches_left = 0  # batches of this pass not yet consumed, the last one included
        self.on_batch = None  # the Accelerator's: which loader gather_for_metrics follows

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        # the pass deals the positions C0..N-1 (C0: where it starts, after a resume)
        self._pass_remaining = max(0, len(sampler.dataset) - sampler._next_start)
        self._local_start = self._last_rows = 0
        self.end_of_dataloader = False
        n_batches = len(self)
        for i, batch in enumerate(super().__iter__()):
            self._local_start += self._last_rows
            self._last_rows = _rows(batch)
            self.end_of_dataloader = i + 1 == n_batches
            self.batches_left = n_batches - i
            if self.on_batch is not None:
                self.on_batch(self)
            yield _to_device(batch, self.device)
        # a pass that ran to its end: the next one is the next epoch
        self.batches_left = 0
        sampler.set_epoch(sampler.epoch + 1)

    def batch_rows(self) -> tuple[int, int, int, int]:
        """``(local_start, rows, num_replicas, remaining)`` of the last batch yielded."""
        s = self.sampler
        return self._local_start, self._last_rows, s.num_replicas, self._pass_remaining


def _rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _rows(next(iter(batch.values())))
    if isinstance(batch, list | tuple):
        return _rows(batch[0])
    return 1


__all__ = ["PreparedDataLoader", "PreparedModel", "PreparedOptimizer", "PreparedScheduler"]
