"""Mixed precision: which dtype the model computes in, and fp16's dynamic loss scaling.

Policy (DeepSpeed's): with ``bf16`` or ``fp16`` enabled the model's parameters,
activations and gradients are 16-bit and the optimizer steps fp32 *master* copies that
the engine keeps beside them (see ``meshtrain.parallel.zero.flat_group``). bf16 has fp32's exponent
range, so it needs no loss scaling; fp16 does.

Dynamic loss scaling (DeepSpeed's ``DynamicLossScaler``, same knobs and meaning):

* the loss is multiplied by ``scale`` (start ``2 ** initial_scale_power``) before
  backward, and gradients are divided by it before the optimizer sees them;
* a step whose gradients contain inf/NaN is *skipped* on every rank. If ``hysteresis``
  overflows have been absorbed, the scale is halved (never below ``min_loss_scale``),
  otherwise one unit of hysteresis is used up;
* after ``loss_scale_window`` consecutive steps without overflow the scale doubles (on
  the next clean step, as DeepSpeed counts: step ``i`` grows it when ``i - last_overflow
  - 1`` is a positive multiple of the window) and hysteresis is restored;
* ``loss_scale > 0`` in the config fixes the scale (static scaling); overflowing steps are
  still skipped.

An overflow that would lower the scale while it already sits at ``min_loss_scale`` means
the model produces inf/NaN whatever the scale. As DeepSpeed's ``DynamicLossScaler``
(``raise_error_at_min_scale``, true by default and in every DeepSpeed engine) the run
stops at once with DeepSpeed's words, "Current loss scale already at minimum - cannot
decrease scale anymore. Exiting run." (a ``TrainingError`` here, with what to try): with
hysteresis left, an overflow at the minimum first uses it up, as DeepSpeed's does.
``fp16.raise_error_at_min_scale: false`` skips such steps instead, and raises after
``max_overflow_steps_at_min`` of them in a row (never skipping forever).

In fp32 and bf16 there is no loss scale (``LossScaler.disabled``) and nothing overflows
by scaling: a non-finite gradient means the loss or the model went to inf/NaN. The step
is still skipped on every rank, and the warning says so in those words (step, precision,
what to try); ``max_overflow_steps_at_min`` such steps in a row raise ``TrainingError``.
"""

from __future__ import annotations

import logging

from meshtrain.errors import TrainingError

log = logging.getLogger("meshtrain")


class LossScaler:
    """Dynamic (or static) loss scale with DeepSpeed's semantics; see the module docstring."""

    def __init__(
        self,
        *,
        dynamic: bool = True,
        static_scale: float = 1.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        max_overflow_steps_at_min: int = 10,
        raise_error_at_min_scale: bool = True,
        precision: str = "fp16",
    ) -> None:
        self.precision = precision  # "fp16", "bf16" or "fp32": chooses the messages
        self.dynamic = dynamic
        self.scale = float(2**initial_scale_power) if dynamic else float(static_scale)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_loss_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.max_overflow_steps_at_min = max_overflow_steps_at_min
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.hysteresis_left = hysteresis
        self.steps = 0
        self.last_overflow_step = -1
        self.overflows_at_min = 0

    @classmethod
    def disabled(cls, precision: str = "fp32") -> LossScaler:
        """Scale 1 that never changes (fp32 and bf16)."""
        return cls(dynamic=False, static_scale=1.0, precision=precision)

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale."""
        if overflow and self.precision != "fp16":
            self._non_finite_unscaled()
        elif overflow:
            lowers = self.dynamic and (self.hysteresis == 1 or self.hysteresis_left == 1)
            if lowers and self.scale == self.min_scale and self.raise_error_at_min_scale:
                raise TrainingError(
                    "Current loss scale already at minimum - cannot decrease scale anymore. "
                    f"Exiting run. (fp16 overflow at step {self.steps} with the loss scale "
                    f"at min_loss_scale={self.min_scale:g}: the model produces inf/NaN "
                    "whatever the scale. Lower the learning rate, enable gradient_clipping, "
                    "or train in bf16; fp16.raise_error_at_min_scale: false skips such steps "
                    "instead, up to fp16.max_overflow_steps_at_min in a row)"
                )
            if self.scale <= self.min_scale:
                self.overflows_at_min += 1
                if self.overflows_at_min >= self.max_overflow_steps_at_min:
                    raise TrainingError(
                        f"fp16 gradients overflowed {self.overflows_at_min} steps in a row "
                        f"with the loss scale at its minimum ({self.min_scale:g}); the model "
                        "produces inf/NaN regardless of scaling. Lower the learning rate, "
                        "enable gradient_clipping, or train in bf16 (bf16.enabled: true)"
                    )
            else:
                self.overflows_at_min = 0
            if self.dynamic:
                if self.hysteresis == 1 or self.hysteresis_left == 1:
                    old = self.scale
                    self.scale = max(self.scale / 2.0, self.min_scale)
                    log.warning(
                        "fp16 overflow at step %d: step skipped, loss scale %g -> %g",
                        self.steps,
                        old,
                        self.scale,
                    )
                else:
                    self.hysteresis_left -= 1
                    log.warning(
                        "fp16 overflow at step %d: step skipped, loss scale kept at %g "
                        "(hysteresis %d left)",
                        self.steps,
                        self.scale,
                        self.hysteresis_left,
                    )
            else:
                log.warning(
                    "fp16 overflow at step %d: step skipped (static loss scale %g)",
                    self.steps,
                    self.scale,
                )
            self.last_overflow_step = self.steps
        else:
            self.overflows_at_min = 0
            if self.dynamic:
                if self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                # DeepSpeed's count: the clean steps since the last overflow before this
                # one; the scale doubles on the step after each ``window`` of them
                stable = self.steps - self.last_overflow_step - 1
                if stable > 0 and stable % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis_left = self.hysteresis
                    self.scale *= 2.0
        self.steps += 1

    def _non_finite_unscaled(self) -> None:
        """fp32/bf16: no scale to lower; say what happened and what to try."""
        self.overflows_at_min += 1
        what = (
            f"non-finite loss or gradient (inf/NaN) at step {self.steps} in "
            f"{self.precision} (no loss scaling is involved in {self.precision})"
        )
        tips = (
            "lower the learning rate or add warmup, enable gradient_clipping (e.g. 1.0), "
            "check the data for inf/NaN or empty label rows, and find the first bad op "
            "with torch.autograd.set_detect_anomaly(True)"
        )
        if self.overflows_at_min >= self.max_overflow_steps_at_min:
            raise TrainingError(
                f"{what}; {self.overflows_at_min} steps in a row were skipped, so training "
                f"cannot continue. Try: {tips}"
            )
        log.warning("%s: step skipped on every rank. If it repeats: %s", what, tips)
        self.last_overflow_step = self.steps

    def state_dict(self) -> dict:
        return {
            k: getattr(self, k)
            for k in ("scale", "hysteresis_left", "steps", "last_overflow_step", "overflows_at_min")
        }

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def scaler_from_config(config) -> LossScaler:
    """The scaler the config asks for: disabled unless fp16 is enabled."""
    fp16 = config.fp16
    if not fp16.enabled:
        bf16 = getattr(config, "bf16", None)
        return LossScaler.disabled("bf16" if bf16 is not None and bf16.enabled else "fp32")
    return LossScaler(
        dynamic=fp16.loss_scale == 0,
        static_scale=fp16.loss_scale or 1.0,
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_loss_scale=fp16.min_loss_scale,
        consecutive_hysteresis=getattr(fp16, "consecutive_hysteresis", False),
        max_overflow_steps_at_min=getattr(fp16, "max_overflow_steps_at_min", 10),
        raise_error_at_min_scale=getattr(fp16, "raise_error_at_min_scale", True),
    )
