"""Gradients across pipeline stages: tied weights summed once, one global norm.

Each rank holds different parameters, so two things need the pipeline group after the
schedule (and the data-parallel reduction) of a step:

* **Tied weights** (an input embedding that is also the LM head): every rank holding
  one has a partial gradient; the sum over holders is the gradient. Under ZeRO 0 and 1
  ``.grad`` is a full view of the flat buffer until the step, so the runtime all-reduces
  it over the holders before the data-parallel reduction (``2 x`` its bytes). Under
  ZeRO 2 ``.grad`` is gone after each backward's reduce-scatter: a rank keeps only the
  part of the tied weight inside its owned chunks, and holders lay their buckets out
  differently, so ``sum_tied_shards`` rebuilds the weight's full gradient first: each dp
  rank writes its owned part into a zero tensor of the weight's size, an all-reduce over
  dp assembles it (the parts are disjoint and cover the weight), an all-reduce over the
  holders sums it, and each rank copies its owned part back. Bytes: ``2 x`` the tied
  weight over dp plus ``2 x`` over the holders, labelled ``pp_tied``.
* **The gradient norm** (clipping, fp16 overflow): ``||g||^2 = sum over pp ranks`` of each
  rank's squared norm, the rank's norm being ``ZeroStage.grad_norm`` (already summed over
  tp, replicated parameters once, and over dp where ZeRO shards), with a tied weight
  counted on its first holder only. One 8-byte all-reduce over pp (``control``); every
  rank gets the same norm, so all clip by the same factor and an inf/NaN anywhere skips
  the step (and lowers the loss scale) on every rank.
"""

from __future__ import annotations

import torch

from meshtrain.distributed import comm


def owned_views(zero, param: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
    """``(view into this rank's reduced gradient chunk, slice of param.view(-1))`` for the
    elements of ``param`` whose reduced gradient this rank holds (all of them without
    ZeRO, a dp-th share with it); empty when ``param`` is in no flat group."""
    for g in zero.flat_groups:
        bucket = g.bucket_of.get(param)
        if bucket is None:
            continue
        off = next(o for q, o in zip(bucket.params, bucket.offsets, strict=True) if q is param)
        n = g.shapes[param].numel()
        lo, hi = g.owned_range(bucket)
        a, z = max(off, bucket.start + lo), min(off + n, bucket.start + hi)
        if a >= z:
            return []
        chunk = g.grad_chunks[bucket.index]
        base = bucket.start + lo
        return [(chunk[a - base : z - base], slice(a - off, z - off))]
    return []


def sum_tied_shards(tied, zero, dp_group) -> None:
    """ZeRO 2: sum each tied weight's reduced gradient over its holders (module doc)."""
    for param, group in tied:
        parts = owned_views(zero, param)
        full = torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
        for view, where in parts:
            full[where] = view
        if dp_group.size > 1:
            comm.all_reduce(full, dp_group, label="pp_tied")
        comm.all_reduce(full, group, label="pp_tied")
        for view, where in parts:
            view.copy_(full[where])


def global_grad_norm(pipe, zero) -> float:
    """Gradient norm over every stage (see the module docstring); inf/NaN if any rank's is.

    A tied weight's reduced gradient is zeroed on its later holders while this rank's
    norm is taken, then put back, so it counts once without subtracting squares (which
    would cancel in fp32).
    """
    later = [v for t, group in pipe.tied if group.rank > 0 for v, _ in owned_views(zero, t)]
    saved = [v.clone() for v in later]
    for v in later:
        v.zero_()
    sq = torch.tensor(zero.grad_norm(), dtype=torch.float64) ** 2
    for v, keep in zip(later, saved, strict=True):
        v.copy_(keep)
    comm.all_reduce(sq, pipe.group, label="control")
    return float(sq.sqrt())


__all__ = ["global_grad_norm", "owned_views", "sum_tied_shards"]
