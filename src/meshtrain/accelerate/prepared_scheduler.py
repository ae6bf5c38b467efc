"""``PreparedScheduler``: accelerate's ``AcceleratedScheduler`` over the user's LR
scheduler. ``step()`` does nothing inside a window or after a skipped (fp16 overflow)
step, else steps the scheduler once per data-parallel process (``split_batches=False``:
the loader's length was divided by them)."""

from __future__ import annotations

from typing import Any

from meshtrain.accelerate.prepared_optimizer import PreparedOptimizer


class PreparedScheduler:
    """accelerate's ``AcceleratedScheduler`` semantics over the user's LR scheduler."""

    def __init__(self, accelerator, scheduler, step_with_optimizer: bool = True) -> None:
        self.accelerator = accelerator
        self.scheduler = scheduler
        self.step_with_optimizer = step_with_optimizer

    def _optimizers(self) -> list[PreparedOptimizer]:
        inner = self.scheduler.optimizer
        return [o for o in self.accelerator.prepared.optimizers if o.optimizer is inner]

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.accelerator.sync_gradients:
            return
        if any(o.step_was_skipped for o in self._optimizers()):
            return
        # split_batches: the loader's length was not divided by the processes: once
        for _ in range(1 if self.accelerator.split_batches else self.accelerator.num_processes):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR without drop_last
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


__all__ = ["PreparedScheduler"]
