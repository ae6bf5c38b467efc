"""``PreparedOptimizer``: the optimizer ``Accelerator.prepare`` hands back. ``step()``
steps the engine when ``sync_gradients`` is True and is a no-op inside an accumulation
window; ``zero_grad()`` clears the gradients at a boundary and is a no-op inside a
window, as accelerate's ``AcceleratedOptimizer``."""

from __future__ import annotations

from meshtrain.accelerate.prepared_model import PreparedModel
from meshtrain.errors import ConfigError


class PreparedOptimizer:
    """The user's optimizer; once its model is prepared it steps the engine's fp32
    master chunks."""

    def __init__(self, accelerator, optimizer) -> None:
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.model: PreparedModel | None = None  # set when the engine is built
        # each param group's parameter names in the optimizer's own order, recorded when
        # the engine is built (it re-points the groups at master chunks): the order
        # accelerate's optimizer.bin is keyed by
        self.param_names: list[list[str]] | None = None
        self.step_was_skipped = False  # the last step hit an fp16 overflow

    @property
    def engine(self):
        return None if self.model is None else self.model.engine

    def record_names(self, module) -> None:
        """Name each group's parameters (of ``module``) in the optimizer's own order."""
        named = {id(p): n for n, p in module.named_parameters()}
        groups = self.optimizer.param_groups
        self.param_names = [[named[id(p)] for p in g["params"]] for g in groups]

    def _need_engine(self):
        if self.engine is None:
            raise ConfigError(
                "optimizer.step(): the model this optimizer's parameters belong to was not "
                "prepared; pass the model to accelerator.prepare (in this call or another)"
            )
        return self.engine

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def step(self, closure=None) -> None:
        """Update the parameters at a boundary (``sync_gradients``); a no-op inside a
        window, as accelerate's."""
        if closure is not None:
            raise ConfigError(
                "optimizer.step(closure): the engine steps fp32 master chunks once per "
                "window and cannot re-evaluate a closure; call step() without it"
            )
        if not self.accelerator.sync_gradients:
            return
        engine = self._need_engine()
        self.model.driver.keep_local()  # a window all inside no_sync: DDP's local step
        # the loss scale still in the gradients (fp16, unless clip_grad_norm_ unscaled them)
        scaled = engine.zero.grad_scale
        engine.step()
        self.model.driver.after_step(scaled)
        self.step_was_skipped = not engine.was_step_applied()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients at a boundary; inside a window they are kept (accelerate)."""
        if not self.accelerator.sync_gradients:
            return
        if self.model is not None:
            self.model.driver.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer.__class__.__name__})"


__all__ = ["PreparedOptimizer"]
