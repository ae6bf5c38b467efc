"""The gradients a script sees: the whole data-parallel gradient of one parameter at any
ZeRO stage, DeepSpeed's ``deepspeed.utils.safe_get_full_grad`` (imported by users as
``meshtrain.utils``), on the ZeRO stage's contract (``ZeroStage.full_grad``).

What ``p.grad`` holds when is the stage's: at every synchronising backward
(``Engine.backward`` at its boundary; the Accelerator's driver at a sync step)
``ZeroStage.average_`` finishes the overlapped reduction at stages 0-1 and averages it in
place (one multiply of the reduced gradient, which the step's copy into the fp32 masters
then does not repeat: ``ZeroStage.grad_scale``); stage 1 then unlinks ``p.grad`` (each
rank holds only its slice). Stages 2-3 reduced in backward already. Inside ``no_sync``
nothing is reduced yet and the step does it.

DeepSpeed's contract (0.19.8, checked against it in tests/conformance/deepspeed):

* after a boundary (synchronising) backward and before the optimizer step;
* ZeRO stage 0: ``p.grad`` itself, which holds the gradient averaged over the
  data-parallel ranks;
* ZeRO stages 1-3: ``p.grad`` is None (each rank keeps only its slice of the reduced
  gradient); the function assembles the averaged gradient in fp32 from every rank's
  slice with one all-reduce of the parameter's size (``4 numel`` bytes, ``2 x`` that in
  ``comm``'s convention) over the replica group, so **every rank must call it** for the
  same parameter;
* in fp16 the gradient still carries the loss scale (the step unscales it);
* outside that interval DeepSpeed raises (its ``ValueError``: "Gradients are only
  available immediately after backward and before engine step"); meshtrain raises
  ``TrainingError`` with the same words.

Which engine a parameter belongs to is recorded on the parameter when the Engine is built
(``_meshtrain_engine``, a weak reference), as DeepSpeed records ``_hp_mapping``.
"""

from __future__ import annotations

import weakref

import torch

from meshtrain.errors import TrainingError

ATTR = "_meshtrain_engine"


def attach(engine) -> None:
    """Record ``engine`` on each trainable parameter it steps (``safe_get_full_grad``
    finds its ZeRO stage from the parameter)."""
    ref = weakref.ref(engine)
    for g in engine.zero.flat_groups:
        for p in g.params:
            setattr(p, ATTR, ref)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``param`` averaged over the data-parallel ranks (module docstring);
    None for a parameter no meshtrain engine trains and that has no ``.grad``."""
    ref = getattr(param, ATTR, None)
    engine = ref() if ref is not None else None
    if engine is None:
        return param.grad
    if not engine.zero.grads_ready:
        raise TrainingError(
            "safe_get_full_grad: Gradients are only available immediately after backward "
            "and before engine step (call it after the window's last, synchronising "
            "backward and before optimizer.step() / engine.step())"
        )
    return engine.zero.full_grad(param)


__all__ = ["attach", "safe_get_full_grad"]
