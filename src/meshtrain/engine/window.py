"""The accumulation window, driven from one place: when a window opens, what every backward
multiplies its loss by, and the ZeRO stage's lifecycle around each backward.

Three ways into training run windows, and each calls this driver (nothing else calls
``begin_window`` / ``before_backward`` / ``after_backward`` / ``average_``):

* ``Engine.backward`` (a DeepSpeed loop, the Trainer, ``train_batch`` without a
  pipeline): micro-step ``i`` of ``k = gradient_accumulation_steps``; the window opens at
  ``i % k == 0`` (or at ``shorten_window``) and its last backward synchronises;
* the Accelerator (``accelerate.grads.EngineDriver``): the window opens at the first
  backward after a step or ``zero_grad``, accelerate's ``sync_gradients`` says which
  backward synchronises, and its loss is already divided by its accumulation steps
  (``k = 1`` here);
* the pipeline (``parallel.pipeline.engine_step.run_window``): the schedule runs the whole
  window's forwards and backwards at once, its loss already the window's mean (``k = 1``);
  ZeRO 0-1 reduce once after it, ZeRO 2 after every micro-batch's backward
  (``schedule``).

Every backward: ``loss x s / (k x f)`` (``ZeroStage.loss_multiplier``: ``s`` the loss scale,
``f`` the gradient pre-division), ``before_backward(sync)``, the backward,
``after_backward``, and after a synchronising one ``average_``, so ``p.grad`` is the
data-parallel mean there (stages 0-1; DeepSpeed's and DDP's contract).

A loss with a weight (``Engine.backward(loss, weight=w)``; the Trainer's ``w = n / N``,
its micro-batch's share of the step's label items): the step's gradient is
``sum over dp ranks and micro-batches of w x grad(loss)``, in place of DeepSpeed's mean
(``w = 1 / (k x dp)``). The reduction sums over the ``dp x cp`` replicas and divides by
``dp x cp / f``, and a dp coordinate's ``cp`` ranks together hold its one loss (each
rank's loss is ``C`` times its share, ``parallel/context/inputs.py``), so the multiplier
is ``s / f x w x dp``, computed once per backward; without a weight it stays
``s / (k x f)`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class AccumulationWindow:
    """The one driver of an accumulation window over ``zero`` (module docstring)."""

    def __init__(self, zero, scaler, log, micro_steps: int) -> None:
        """``scaler``: the loss scaler whose scale every backward applies; ``log``: the step
        log the backward's time goes to; ``micro_steps``: backwards per window
        (``gradient_accumulation_steps``)."""
        self.zero = zero
        self.scaler = scaler
        self.log = log
        self.micro_steps = micro_steps

    def open(self) -> None:
        """A fresh window: the next backward is its first."""
        self.zero.begin_window()

    def before_backward(
        self, synchronise: bool, micro_steps: int | None = None, weight: float | None = None
    ) -> float:
        """Ready the stage for one backward; return its loss multiplier (``micro_steps``:
        the backwards its loss is one of, default the window's; ``weight``: the loss's
        weight in the step's gradient, module docstring, which replaces ``1 / (k x dp)``)."""
        if weight is None:
            k = self.micro_steps if micro_steps is None else micro_steps
            multiplier = self.zero.loss_multiplier(self.scaler.scale, k)
        else:  # s / f, then the weight over the dp ranks the reduction averages
            dp = self.zero.topology.dp_size
            multiplier = self.zero.loss_multiplier(self.scaler.scale, 1) * (weight * dp)
        self.zero.before_backward(synchronise)
        return multiplier

    def after_backward(self, synchronise: bool) -> None:
        """One backward's end: the reduction as the stage says; after a synchronising
        backward the gradients are averaged in place and final."""
        self.zero.after_backward()
        if synchronise:
            self.average()

    def average(self) -> None:
        self.zero.average_()  # DeepSpeed's p.grad: averaged in place (stages 0-1)

    def backward(self, loss: torch.Tensor, synchronise: bool, weight: float | None = None) -> None:
        """One backward of ``loss`` (a micro-step's, with its ``weight`` in the step's
        gradient or DeepSpeed's mean), timed in the step log."""
        multiplier = self.before_backward(synchronise, weight=weight)
        with self.log.timed("backward"):
            (loss.float() * multiplier).backward()
            self.zero.after_backward()
        if synchronise:
            self.average()

    def schedule(self, run: Callable[[float, Callable | None], torch.Tensor]) -> torch.Tensor:
        """A pipeline's window: ``run(loss_scale, after_backward)`` runs the schedule's
        forwards and backwards; ZeRO 0-1 hooks are told not to reduce (the step's
        ``before_step`` reduces once), ZeRO 2 reduces after each micro-batch's backward
        (``after_backward``, which at 0-1 lands a split backward's weight gradients in the
        flat buffer). Returns what ``run`` returns."""
        self.open()
        multiplier = self.before_backward(False, 1)
        return run(multiplier, self.zero.after_backward)
