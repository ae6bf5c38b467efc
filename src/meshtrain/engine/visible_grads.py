"""The gradients a script sees: what ``p.grad`` holds when, and the whole data-parallel
gradient of one parameter at any ZeRO stage, DeepSpeed's
``deepspeed.utils.safe_get_full_grad`` (imported by users as ``meshtrain.utils``).

``finish_reduction`` runs at every synchronising backward (``Engine.backward`` at its
boundary; the Accelerator's driver at a sync step): stages 0-1 finish the overlapped
reduction there and average it in place (the sum over ranks x ``f / dp``: one multiply of
the reduced gradient, which the step's copy into the fp32 masters then does not repeat,
``engine.grads_divided_by``; in fp32 without clipping the pass moved, it was not added);
stage 1 then unlinks ``p.grad`` (each rank holds only its slice). Stages 2-3 reduced in
backward already. Inside ``no_sync`` nothing is reduced yet and the step does it.

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

from meshtrain.distributed import comm
from meshtrain.errors import TrainingError

ATTR = "_meshtrain_engine"


def finish_reduction(engine) -> None:
    """A synchronising backward's end (module docstring)."""
    zero = engine.zero
    if zero.stage < 2:
        if not zero.synchronising:
            return
        # wait for the buckets in flight and launch the rest; directly, not through
        # before_step: a second synchronising backward in one window (a GAN's
        # discriminator reached again) reduces again, and adds to the average
        zero.finish_window_reduction()
        # every reduction sums dp copies: back to the mean (what it held plus the mean of
        # what was added since, DDP's result)
        if zero.grad_divisor != 1.0:
            for g in zero.flat_groups:
                for chunk in g.grad_chunks:
                    chunk.mul_(1.0 / zero.grad_divisor)
        engine.grads_divided_by = zero.grad_divisor
        for g in zero.flat_groups:
            if g.sharded:  # stage 1: the rest of grad_flat is not the global gradient
                for p in g.grad_views:
                    p.grad = None
    engine.grads_ready = True


def attach(engine) -> None:
    """Record ``engine`` on each trainable parameter it steps; no gradients to read yet
    (``engine.grads_ready``: from a synchronising backward until the step)."""
    engine.grads_ready = False
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
    if not engine.grads_ready:
        raise TrainingError(
            "safe_get_full_grad: Gradients are only available immediately after backward "
            "and before engine step (call it after the window's last, synchronising "
            "backward and before optimizer.step() / engine.step())"
        )
    zero = engine.zero
    # expert parameters live in their own part (``ZeroStages``), reduced over edp
    owners = [(kind, g) for kind in getattr(zero, "parts", [zero]) for g in kind.flat_groups]
    for kind, g in owners:
        bucket = g.bucket_of.get(param)
        if bucket is None:
            continue
        if not g.sharded:  # stage 0: p.grad is the averaged gradient (DeepSpeed returns it)
            return param.grad
        # stages 1-3: this rank's slice of the flat bucket, the rest from their owners
        shape = g.shapes[param]
        i = next(k for k, q in enumerate(bucket.params) if q is param)
        start = bucket.offsets[i] - bucket.start  # bucket-local
        out = torch.zeros(shape.numel(), dtype=torch.float32, device=g.device)
        lo = max(start, g.rank * bucket.chunk)
        hi = min(start + shape.numel(), (g.rank + 1) * bucket.chunk)
        if hi > lo:
            chunk = g.grad_chunks[bucket.index]
            part = chunk.narrow(0, lo - g.rank * bucket.chunk, hi - lo)
            out.narrow(0, lo - start, hi - lo).copy_(part)
        comm.all_reduce(out, kind.replicas, label="full_grad")
        # the slices hold the sum over ranks (x loss scale / f) unless already averaged
        divisor = zero.grad_divisor / engine.grads_divided_by
        if divisor != 1.0:
            out.mul_(1.0 / divisor)
        return out.view(shape)
    return param.grad


__all__ = ["attach", "finish_reduction", "safe_get_full_grad"]
