"""Reduce-scatter and all-gather of flat buckets, with the cheaper primitive per backend.

ZeRO needs two collectives over a bucket of ``n`` elements split into ``N`` chunks (one
per data-parallel rank): a *reduce-scatter* (rank ``r`` gets the sum of chunk ``r``) and
an *all-gather* (every rank gets every rank's chunk). On CUDA (NCCL) the native
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` are used as they are.

On CPU (gloo) the native ones are the slow way. gloo implements ``reduce_scatter_tensor``
as "clone the input, all-reduce the clone, copy the chunk out", and
``all_gather_into_tensor`` through a full-size temporary and a copy. Measured on the
2-core machine, 2 ranks, 7 buckets of 38 MiB (wall / process CPU ms):

=============================  ===========  ===========================================
operation                      native       what is used here instead
=============================  ===========  ===========================================
reduce-scatter                 279 / 259    in-place ``all_reduce`` of the bucket: 150 / 115
all-gather                     234 / 199    each rank ``broadcast``\\s its own chunk in
                                            place (``N`` broadcasts): 75 / 52
=============================  ===========  ===========================================

The replacement for the reduce-scatter leaves the *whole* bucket summed (not only this
rank's chunk), so the caller's bucket buffer must be scratch, or a buffer whose other
chunks it no longer reads (stage 1's full gradient: only the owned chunk is used and the
buffer is zeroed after the step). gloo puts the same bytes on the wire either way, since
its reduce-scatter is an all-reduce inside.

Byte accounting. The *logical* operation is recorded, whatever the primitive: a
reduce-scatter as the bytes of the full bucket under ``reduce_scatter`` and an all-gather
as the bytes of the full bucket under ``all_gather``, exactly as
``meshtrain.distributed.comm`` records the native calls. The ZeRO volume convention (and
``meshtrain.parallel.zero.plan.comm_bytes_theory``, asserted exactly by the tests) is
therefore unchanged by the choice of primitive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def use_cheap_primitives(t: torch.Tensor) -> bool:
    """True where all-reduce / broadcasts beat reduce-scatter / all-gather: CPU (gloo)."""
    return t.device.type == "cpu"


class _Works:
    """Several works as one, with an optional copy once they are done."""

    def __init__(self, works: list, then=None) -> None:
        self.works, self.then = works, then

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        if self.then is not None:
            self.then()
            self.then = None
        return True


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Group, async_op: bool = True):
    """``out`` (``full.numel() / N`` elements) receives the sum over ranks of this rank's
    chunk of ``full``. On CPU ``full`` is summed whole in place (module docstring);
    ``out`` may be ``full``'s own chunk. Returns a work (``wait()`` lands ``out``)."""
    if group.size == 1 or not use_cheap_primitives(full):
        work = comm.reduce_scatter(out, full, group, async_op=async_op)
        return work if async_op else None
    if full.numel() != out.numel() * group.size:
        raise ValueError(
            f"reduce_scatter over {group.name} (size {group.size}): input has "
            f"{full.numel()} elements, expected output {out.numel()} x {group.size}"
        )
    group.stats.record("reduce_scatter", group.name, _nbytes(full), group.size)
    # through comm's ledger wrapper, so the hang doctor sees it like any other collective
    work = comm._call(
        group, "all_reduce", (full,), True, dist.all_reduce, full, group=group.pg, async_op=True
    )
    mine = full.narrow(0, group.rank * out.numel(), out.numel())
    then = None if _aliases(mine, out) else (lambda: out.copy_(mine))
    done = _Works([work], then)
    if not async_op:
        done.wait()
        return None
    return done


def all_gather(full: torch.Tensor, mine: torch.Tensor, group: Group, async_op: bool = True):
    """``full`` receives every rank's ``mine`` in group-rank order; ``mine`` may be
    ``full``'s own chunk (in place). On CPU: one broadcast per rank of its chunk."""
    if group.size == 1 or not use_cheap_primitives(full):
        work = comm.all_gather(full, mine, group, async_op=async_op)
        return work if async_op else None
    n = mine.numel()
    if full.numel() != n * group.size:
        raise ValueError(
            f"all_gather over {group.name} (size {group.size}): output has "
            f"{full.numel()} elements, expected input {n} x {group.size}"
        )
    group.stats.record("all_gather", group.name, _nbytes(full), group.size)
    own = full.narrow(0, group.rank * n, n)
    if not _aliases(own, mine):
        own.copy_(mine)
    works = [
        dist.broadcast(
            full.narrow(0, r * n, n), src=group.global_rank(r), group=group.pg, async_op=True
        )
        for r in range(group.size)
    ]
    done = _Works(works)
    if not async_op:
        done.wait()
        return None
    return done
