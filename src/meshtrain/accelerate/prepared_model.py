"""``PreparedModel``: the model ``Accelerator.prepare`` hands back. Calling it runs the
model with the arguments as given: through its Engine once one is built (device placement,
model dtype, ZeRO-3 gathering), else the module itself (a model prepared for evaluation
only, or whose optimizer is not prepared yet); any other attribute is the module's. A
model and its optimizer may come in one ``prepare`` call or in different ones, in any
order: the Engine is built when both are known (the Accelerator links them by the
optimizer's parameters)."""

from __future__ import annotations

from typing import Any


class PreparedModel:
    """The model as prepared: calling it runs the engine's forward (or, with no engine,
    the module under the Accelerator's autocast); attributes fall through to the module."""

    def __init__(self, accelerator, module) -> None:
        self.__dict__["accelerator"] = accelerator
        self.__dict__["module"] = module
        self.__dict__["engine"] = None
        self.__dict__["driver"] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            return self.engine(*args, **kwargs)
        with self.accelerator.autocast():
            return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> PreparedModel:
        self.module.train(mode)
        return self

    def eval(self) -> PreparedModel:
        return self.train(False)

    def no_sync(self):
        """DDP's ``model.no_sync()`` (local SGD, hand-written accumulation): backward
        passes inside keep their gradients local; ``Accelerator.no_sync``."""
        return self.accelerator.no_sync(self)

    def __getattr__(self, name: str) -> Any:  # parameters(), config, generate, ...
        return getattr(self.module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.module, name, value)

    def __repr__(self) -> str:
        where = "no engine" if self.engine is None else f"zero_stage={self.engine.zero_stage}"
        return f"PreparedModel({self.module.__class__.__name__}, {where})"


__all__ = ["PreparedModel"]
