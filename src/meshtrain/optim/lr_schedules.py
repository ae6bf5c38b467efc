"""Learning-rate schedules from the DeepSpeed config's ``scheduler`` section.

Schedules are DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``
(``deepspeed/runtime/lr_schedules.py``, checked against DeepSpeed 0.19.8), reimplemented with
the same parameter names, defaults, formulas and floating-point operation order, so the lr is
bit-identical to DeepSpeed's before the first step and after every ``step()``. Like
DeepSpeed, a schedule is stepped once per *applied* optimizer step, after it (the engine
skips it on an fp16 overflow). Their ``state_dict`` is ``{"last_batch_iteration": int}``,
plain JSON, as DeepSpeed's.

Deviations from DeepSpeed, each on purpose:

* a bad value (unknown ``warmup_type``, ``warmup_num_steps`` < 1, a per-group list of the
  wrong length, an unknown parameter name) raises :class:`~meshtrain.errors.ConfigError`
  naming its config path; DeepSpeed warns and falls back to ``log`` for an unknown
  ``warmup_type``, and raises a bare ``TypeError``/``ValueError`` for the rest;
* lr values that come from the optimizer rather than the config (WarmupCosineLR's base lr,
  WarmupLR's ``warmup_max_lr`` when absent) are remembered in each param group as
  ``initial_lr`` (torch's scheduler convention), so they survive in the optimizer's
  state_dict and a scheduler built *after* the optimizer state was restored still sees the
  config lr, not the scheduled one;
* ``load_state_dict`` and a constructor ``last_step >= 0`` write the lr of that step into
  the optimizer at once (DeepSpeed leaves it to the restored optimizer state, which holds
  the same value), so ``get_last_lr()`` always works.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshtrain.errors import ConfigError
from meshtrain.optim.optimizers import canonical_name, check_names

__all__ = [
    "SUPPORTED_SCHEDULERS",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

logger = logging.getLogger(__name__)

SUPPORTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _set_lrs(optimizer: Any, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):  # tensor lr (capturable/fused): keep the tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


def _initial_lrs(optimizer: Any) -> list[float]:
    # float(): a tensor lr is updated in place, so keeping the tensor would alias it.
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", float(group["lr"]))
    return [float(group["initial_lr"]) for group in optimizer.param_groups]


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    return float(value)


def _per_group(value: Any, optimizer: Any, path: str) -> list[float]:
    n = len(optimizer.param_groups)
    values = list(value) if isinstance(value, list | tuple) else [value] * n
    if len(values) != n:
        raise ConfigError(
            f"{path}: expected one value or a list of {n} (one per param group), got {value!r}"
        )
    return [_number(v, path) for v in values]


def _positive_int(value: Any, path: str, minimum: int = 1) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{path}: expected {what}, got {value!r}")
    return value


def _warmup_type(value: Any, path: str) -> str:
    if value not in ("log", "linear"):
        raise ConfigError(f"{path}: expected 'log' or 'linear', got {value!r}")
    return value


class _Schedule:
    """Shared mechanics: the lr of iteration ``last_batch_iteration`` is written to the optimizer."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, self.get_lr())

    def get_lr(self) -> list[float]:
        """The lr of each param group at ``last_batch_iteration`` (-1: before training)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lr last written to each param group."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``last_batch_iteration``) and set the lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        """``{"last_batch_iteration": int}`` -- JSON-serialisable, DeepSpeed's format."""
        return {"last_batch_iteration": int(self.last_batch_iteration)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["last_batch_iteration"]`` and write that step's lr."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())


class WarmupLR(_Schedule):
    """DeepSpeed's WarmupLR: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    With ``t = last_batch_iteration`` (the number of ``step()`` calls minus one), ``W =
    max(2, warmup_num_steps)``, ``lo = warmup_min_lr``, ``hi = warmup_max_lr``::

        lr(t) = lo                                      t < 0  (at construction)
        lr(t) = lo + (hi - lo) * (1/ln W) * ln(t + 1)   t < W, warmup_type "log"
        lr(t) = lo + (hi - lo) * t / W                  t < W, warmup_type "linear"
        lr(t) = hi                                      t >= W

    So the first optimizer step runs at ``lo`` and, since ``lr(0) = lo`` too, so does the
    second. Defaults: ``warmup_min_lr=0``, ``warmup_max_lr`` = the optimizer's lr (first
    group; older DeepSpeed releases used 0.001), ``warmup_num_steps=1000``,
    ``warmup_type="log"``.
    ``warmup_min_lr``/``warmup_max_lr`` may be lists, one value per param group.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = _initial_lrs(optimizer)[0]
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "scheduler.params.warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "scheduler.params.warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        n = _positive_int(warmup_num_steps, "scheduler.params.warmup_num_steps", minimum=0)
        self.warmup_num_steps = max(2, n)
        self.warmup_type = _warmup_type(warmup_type, "scheduler.params.warmup_type")
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [
            lo + (delta * gamma) for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)
        ]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then linear decay back to ``warmup_min_lr``.

    Warmup exactly as :class:`WarmupLR` (same ``W``, ``lo``, ``hi``); after it, with ``T =
    total_num_steps``::

        lr(t) = lo + (hi - lo) * max(0, (T - t) / max(1, T - W))     t >= W

    so ``lr(W) = hi`` and the lr reaches ``lo`` at ``t = T`` and stays there. Defaults as
    WarmupLR except ``warmup_max_lr=0.001`` (DeepSpeed passes it explicitly here);
    ``total_num_steps`` is required.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "scheduler.params.total_num_steps")
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_Schedule):
    """DeepSpeed's WarmupCosineLR: a ratio of the optimizer's lr, warmed up then cosine-decayed.

    With ``base`` = each group's lr when the schedule was built (its ``initial_lr``), ``W =
    max(2, warmup_num_steps)``, ``T = total_num_steps``, ``m = warmup_min_ratio``, ``c =
    cos_min_ratio``, ``lr(t) = base * ratio(t)`` where::

        ratio(t) = 0                                          t < 0  (at construction!)
        ratio(t) = m + (1 - m) * (1/ln W) * ln(t + 1)         t < W, warmup_type "log"
        ratio(t) = m + (1 - m) * t / W                        t < W, warmup_type "linear"
        ratio(t) = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2)    t >= W, with
               p = min(1, (t - W + 1) / max(1, T - W))

    Note the first optimizer step runs at lr 0 (not ``base * m``): DeepSpeed's behaviour.
    Defaults: ``warmup_min_ratio=0``, ``warmup_num_steps=1000``, ``cos_min_ratio=0.0001``,
    ``warmup_type="log"``; ``total_num_steps`` is required.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "scheduler.params.total_num_steps")
        self.warmup_min_ratio = _number(warmup_min_ratio, "scheduler.params.warmup_min_ratio")
        self.cos_min_ratio = _number(cos_min_ratio, "scheduler.params.cos_min_ratio")
        n = _positive_int(warmup_num_steps, "scheduler.params.warmup_num_steps", minimum=0)
        self.warmup_num_steps = max(2, n)
        self.warmup_type = _warmup_type(warmup_type, "scheduler.params.warmup_type")
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )
        self.org_lrs = _initial_lrs(optimizer)
        super().__init__(optimizer, last_batch_iteration)

    def get_lr_ratio(self) -> float:
        """``ratio(last_batch_iteration)`` of the class docstring."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(t + 1)
            else:
                ratio = t / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = t - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]


_SCHEDULES: dict[str, tuple[Callable[..., _Schedule], tuple[str, ...]]] = {
    "WarmupLR": (WarmupLR, ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")),
    "WarmupDecayLR": (
        WarmupDecayLR,
        ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    ),
    "WarmupCosineLR": (
        WarmupCosineLR,
        ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
    ),
}


def build_scheduler(
    sched_type: str, params: dict[str, Any], optimizer: Any, *, last_step: int = -1
) -> _Schedule:
    """Build the DeepSpeed schedule a ``scheduler`` config section describes.

    Args:
        sched_type: ``WarmupLR``, ``WarmupDecayLR`` or ``WarmupCosineLR`` (case-insensitive).
        params: the section's ``params`` with DeepSpeed's names; absent ones take
            DeepSpeed's defaults (see each class).
        optimizer: anything with torch-style ``param_groups``; build the schedule right
            after the optimizer, as DeepSpeed does: it sets the optimizer's lr at once.
        last_step: ``last_batch_iteration`` to start from; -1 starts from the beginning.

    Raises:
        ConfigError: unknown type or parameter, a missing ``total_num_steps``, a bad value.
    """
    name = canonical_name(sched_type, SUPPORTED_SCHEDULERS, "scheduler.type")
    cls, allowed = _SCHEDULES[name]
    check_names(params, allowed, "scheduler.params", name)
    if "total_num_steps" in allowed and "total_num_steps" not in params:
        raise ConfigError(
            f"scheduler.params.total_num_steps: required for {name} (the number of optimizer steps)"
        )
    return cls(optimizer, **params, last_batch_iteration=int(last_step))
