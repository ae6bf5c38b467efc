"""Where an Engine's elements sit in a checkpoint: the mapping both the save
(``checkpoint_save.py``) and the load (``checkpoint_load.py``) use.

What an Engine saves and how it loads it back under any data-parallel size / ZeRO stage.

Save: every rank describes the elements it is responsible for as ``Piece``s over each
parameter's *flattened* index, so the files say nothing about the layout that wrote
them. For a ``FlatGroup`` bucket of ``n`` padded elements a rank writes

* ZeRO stages 1-3 (``P = dp`` partitions): its own chunk ``[r n / P, (r + 1) n / P)``
  of the fp32 master weights and of each optimizer state (what it holds anyway);
* stage 0 (``P = 1``, every rank holds everything): the slice ``[r c, (r + 1) c)``,
  ``c = ceil(n / dp)``, so the ranks still share the writing.

Frozen parameters and persistent buffers (whole on every rank) are split the same way
over the world; under ZeRO-3 sharded frozen parameters are gathered for it one unit
bucket at a time, and on load each rank writes its own chunk of them. Scalars (optimizer ``step``, counters, loss scale, scheduler, data-loader
position, python/numpy RNG) go in the JSON rank state; the torch RNG state tensors in
the rank's file.

Load: each rank asks the reader for exactly the element ranges it owns in its *own*
layout (padding stays zero) -- a parameter's elements come from whichever files hold
them. The fp32 masters are the source of truth: parameters are then written from them
(and all-gathered for stages 1-2), exactly as after an optimizer step, so a resumed run
continues bit-identically. Tensor parallelism: a rank's parameters are shards, but its pieces are named in the FULL
parameter's flattened index space (``parallel.tensor.sharding.full_runs``; padding is
not written), replicated parameters are written by tensor-parallel rank 0 only, and the
meta records full shapes. So a checkpoint saved at tp 2 x dp 2 loads at tp 1 x dp 4 or
tp 4 with no conversion: each rank reads the full-index runs of its own shard. RNG states
are restored only when the world size matches
(per-rank streams have no meaning under another layout); the data-loader position is a
count of consumed samples, which the sampler re-deals over the new replica count.

Pipeline parallelism: every stage writes its own parameters, optimizer states and
buffers under the UNSPLIT model's names (``model_names``), frozen tensors and buffers
split over the ranks holding the stage; a tensor several stages hold (a tied embedding)
is written once, by the lowest pp rank holding it. The meta lists the whole model
(gathered over pp), so a checkpoint saved at pp 2 x dp 2 loads at pp 1 x dp 4 or pp 4:
each rank reads the names of its own stages.
"""

from __future__ import annotations

import torch

from meshtrain.engine.engine_view import EngineView
from meshtrain.parallel.tensor.sharding import ShardSpec, full_runs, specs_by_param, tp_specs
from meshtrain.parallel.zero.flat_group import Bucket, FlatGroup


def save_range(g: FlatGroup, b: Bucket, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """(lo, hi) bucket-local elements this rank writes, and where its master chunk starts."""
    if g.sharded:
        lo, hi = g.owned_range(b)
        return lo, hi, lo
    c = -(-b.numel // dp)
    return min(dp_rank * c, b.numel), min((dp_rank + 1) * c, b.numel), 0


def runs(
    g: FlatGroup,
    b: Bucket,
    lo: int,
    hi: int,
    names: dict[int, str],
    tp: tuple[dict[int, ShardSpec], int] | None = None,
    writing: bool = False,
    ep: tuple[dict[int, ShardSpec], int] | None = None,
):
    """(name, start in the FULL param, bucket-local offset, numel) for each param
    overlapping ``[lo, hi)``. ``tp``: (specs by param id, tp rank) under tensor
    parallelism; ``writing`` leaves replicated params to tp rank 0. ``ep``: (specs of
    the expert parameters, ep rank) under expert parallelism (``expert_layout``)."""
    specs, tp_rank = tp if tp is not None else ({}, 0)
    for p, off in zip(b.params, b.offsets, strict=True):
        a, z = off - b.start, off - b.start + g.shapes[p].numel()
        s, e = max(a, lo), min(z, hi)
        if s >= e:
            continue
        espec = ep[0].get(id(p)) if ep is not None else None
        if espec is not None:  # this ep rank's experts, named by their global index
            if not (writing and tp_rank):
                for rel, full_start, n in full_runs(espec, tuple(g.shapes[p]), ep[1], s - a, e - s):
                    yield names[id(p)], full_start, s + rel, n
            continue
        spec = specs.get(id(p))
        if spec is None:
            if not (writing and tp_rank):
                yield names[id(p)], s - a, s, e - s
            continue
        for rel, full_start, n in full_runs(spec, tuple(g.shapes[p]), tp_rank, s - a, e - s):
            yield names[id(p)], full_start, s + rel, n


def tp_of(engine: EngineView) -> tuple[dict[int, ShardSpec], int] | None:
    if engine.topology.tp_size == 1:
        return None
    return specs_by_param(engine.module), engine.topology.tp_rank


def unsplit_view(engine: EngineView) -> torch.nn.Module:
    """The model (for its ``config``): under pp, a split stage's view of it."""
    if engine.pipeline is None:
        return engine.module
    stage = next(iter(engine.module.stages.values()))
    return getattr(stage, "model", stage)


def frozen_specs(engine: EngineView) -> dict[str, ShardSpec]:
    """State-dict keys of tensor-parallel shards that are not trainable (frozen)."""
    if engine.topology.tp_size == 1:
        return {}
    trainable = {id(p) for g in engine.zero.flat_groups for p in g.params}
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    return {k: s for k, s in tp_specs(engine.module).items() if id(params.get(k)) not in trainable}
