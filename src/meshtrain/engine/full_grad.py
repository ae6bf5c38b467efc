"""The whole data-parallel gradient of one parameter, whatever the ZeRO stage: DeepSpeed's
``deepspeed.utils.safe_get_full_grad`` (imported by users as ``meshtrain.utils``).

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


def attach(engine) -> None:
    """Record ``engine`` on each trainable parameter it steps."""
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
    for g in zero.flat_groups:
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
        comm.all_reduce(out, zero.replicas, label="full_grad")
        # the slices hold the sum over ranks (x loss scale / f) unless already averaged
        divisor = zero.grad_divisor / engine.grads_divided_by
        if divisor != 1.0:
            out.mul_(1.0 / divisor)
        return out.view(shape)
    return param.grad


__all__ = ["attach", "safe_get_full_grad"]
