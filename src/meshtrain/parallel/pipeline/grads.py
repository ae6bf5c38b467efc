"""Gradients across pipeline stages: tied weights summed once, one global norm.

Each rank holds different parameters, so two things need the pipeline group after the
schedule (and the data-parallel reduction) of a step:

* **Tied weights** (an input embedding that is also the LM head): every rank holding
  one has a partial gradient; the sum over holders is the gradient. Under ZeRO 0 and 1
  ``.grad`` is a full view of the flat buffer until the step, so the runtime all-reduces
  it over the holders before the data-parallel reduction (``2 x`` its bytes). Under
  ZeRO 2 ``.grad`` is gone after each backward's reduce-scatter: a rank keeps only the
  part of the tied weight inside its owned chunks, and holders lay their buckets out
  differently, so ``sum_tied_shards`` rebuilds the weight's full gradient first (the ZeRO
  stage does, ``ZeroStage.sum_tied_grad``: its buffers are its own): each dp
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


def sum_tied_shards(tied, zero, dp_group) -> None:
    """ZeRO 2: sum each tied weight's reduced gradient over its holders (module doc;
    ``ZeroStage.sum_tied_grad``)."""
    for param, group in tied:
        zero.sum_tied_grad(param, group, dp_group)


def global_grad_norm(pipe, zero) -> float:
    """Gradient norm over every stage (see the module docstring); inf/NaN if any rank's is.

    A tied weight's reduced gradient is left out on its later holders
    (``ZeroStage.grad_norm``'s ``leave_out``), so it counts once without subtracting
    squares (which would cancel in fp32).
    """
    later = [t for t, group in pipe.tied if group.rank > 0]
    sq = torch.tensor(zero.grad_norm(leave_out=later), dtype=torch.float64) ** 2
    comm.all_reduce(sq, pipe.group, label="control")
    return float(sq.sqrt())


__all__ = ["global_grad_norm", "sum_tied_shards"]
