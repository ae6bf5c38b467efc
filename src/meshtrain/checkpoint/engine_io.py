"""What an Engine saves and how it loads it back under any data-parallel size / ZeRO stage.

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

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.checkpoint import expert_layout as experts
from meshtrain.checkpoint import slice_state, storage
from meshtrain.checkpoint.manifest import Piece
from meshtrain.checkpoint.model_names import model_names
from meshtrain.checkpoint.reader import CheckpointReader
from meshtrain.checkpoint.slice_state import load_slice_states, save_slice_states
from meshtrain.checkpoint.writer import save_shards
from meshtrain.errors import CheckpointError
from meshtrain.parallel.tensor.sharding import (
    ShardSpec,
    full_runs,
    shard_tensor,
    specs_by_param,
    unshard_tensor,
)
from meshtrain.parallel.zero.flat_group import Bucket, FlatGroup
from meshtrain.parallel.zero.frozen import whole_state_items

log = logging.getLogger("meshtrain")


def _save_range(g: FlatGroup, b: Bucket, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """(lo, hi) bucket-local elements this rank writes, and where its master chunk starts."""
    if g.sharded:
        lo, hi = g.owned_range(b)
        return lo, hi, lo
    c = -(-b.numel // dp)
    return min(dp_rank * c, b.numel), min((dp_rank + 1) * c, b.numel), 0


def _runs(
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


def _tp(engine) -> tuple[dict[int, ShardSpec], int] | None:
    if engine.topology.tp_size == 1:
        return None
    return specs_by_param(engine.module), engine.topology.tp_rank


def _rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    py = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]], "numpy": [kind, pos, has_gauss, cached]}
    tensors = {
        "rng.torch": torch.get_rng_state(),
        "rng.numpy": torch.from_numpy(keys.astype(np.int64)),
    }
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return state, tensors


def _set_rng(state: dict, reader: CheckpointReader, rank: int) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, pos, has_gauss, cached = state["numpy"]
    keys = reader.rank_tensor(rank, "rng.numpy").numpy().astype(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    torch.set_rng_state(reader.rank_tensor(rank, "rng.torch"))
    if torch.cuda.is_available() and "rng.cuda" in reader.rank_keys(rank):
        torch.cuda.set_rng_state(reader.rank_tensor(rank, "rng.cuda"))


def save(
    engine,
    save_dir,
    tag: str | None = None,
    client_state: dict | None = None,
    on_commit=None,
) -> Path:
    """``engine.save_checkpoint`` (see the module docstring). With ``checkpoint.async_save``
    the tensors are staged on the host and written in the background
    (:mod:`meshtrain.checkpoint.async_save`); the returned path exists once the write is
    committed. ``on_commit(path)`` runs on every rank after the commit (at once for a
    synchronous save, in the background thread for an asynchronous one)."""
    saver = getattr(engine, "checkpoint_saver", None)
    if saver is not None:
        saver.wait()  # a second save waits for the first (and raises its failure)
    tag, args = shard_contents(engine, tag, client_state)
    if engine.config.checkpoint.async_save:
        engine.async_saver().submit(
            save_shards, save_dir=save_dir, tag=tag, on_commit=on_commit, **args
        )
        return Path(save_dir) / tag
    path = save_shards(save_dir, tag, **args)
    if on_commit is not None:
        on_commit(path)
    return path


def shard_contents(engine, tag: str | None, client_state: dict | None) -> tuple[str, dict]:
    """(the agreed tag, ``save_shards`` keyword arguments) of this rank's part of a save:
    ``tensors`` (views of the live state where they can be: copy them before training on),
    ``pieces``, ``rank_state``, ``meta``, ``group``, ``keep_last``. A collective (the tag)."""
    topo = engine.topology
    world = topo.group("world")
    replicas = topo.replica_group  # dp x cp hold the same weights: each writes its share
    tag = _agreed_tag(tag or f"global_step{engine.global_steps}", world, engine.config)
    names = model_names(engine)
    canon, aliases, meta_tensors = names.canon, names.aliases, names.tensors
    tp = _tp(engine)
    ep = experts.expert_specs(engine)
    writers = experts.stage0_writers(engine)
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[Piece] = []
    steps = set()
    opt_state = engine.optimizer.state
    for gi, g in enumerate(engine.zero.flat_groups):
        for b, master in zip(g.buckets, g.master_chunks, strict=True):
            lo, hi, base = _save_range(g, b, *writers[id(g)])
            if hi <= lo:
                continue
            sources = {"param": master.detach()}
            # element-wise states as pieces; the others per rank (``slice_state``)
            joined = g.optimizer_state(b, opt_state) if g.layout == "flat" else {}
            for k, v in joined.items():  # joined over its slices
                if isinstance(v, torch.Tensor) and v.shape == master.shape:
                    sources[k] = v
                elif k == "step":
                    steps.add(float(v))
            for state, src in sources.items():
                key = f"g{gi}.b{b.index}.{state}"
                tensors[key] = src[lo - base : hi - base].detach().float().cpu().contiguous()
                for name, start, local, n in _runs(g, b, lo, hi, canon, tp, True, ep):
                    if names.writes(name, topo.pp_rank):  # a tied weight: its first stage
                        pieces.append(Piece(name, state, key, local - lo, start, n))
    frozen_specs = _frozen_specs(engine)
    # frozen tensors and buffers: split over the ranks holding this stage (the world at pp 1)
    share, part = replicas.size * topo.tp_size, replicas.rank * topo.tp_size + topo.tp_rank
    done: set[str] = set()  # a module two stages of this rank share is listed twice
    frozen_ids = {id(p) for g in engine.zero.frozen_groups for p in g.params}
    for key, t in whole_state_items(engine.module, engine.zero):
        name = canon[id(t)]
        if names.keys[key] in aliases or meta_tensors[name]["kind"] == "param" or name in done:
            continue
        done.add(name)
        if not names.writes(name, topo.pp_rank):
            continue
        gathered = id(t) in frozen_ids  # ZeRO-3 frozen: freed with the next bucket
        t = t.detach()
        if key in frozen_specs:  # a frozen tensor-parallel shard: write the full tensor
            t = unshard_tensor(t, frozen_specs[key], topo.tp_group)
        flat = t.reshape(-1)
        n_share, n_part, offset = experts.frozen_split(engine, ep, t, key, share, part)
        c = -(-flat.numel() // n_share)
        lo, hi = min(n_part * c, flat.numel()), min((n_part + 1) * c, flat.numel())
        if hi > lo:
            chunk = flat[lo:hi].cpu().contiguous()
            tensors[f"x.{name}"] = chunk.clone() if gathered else chunk
            pieces.append(Piece(name, "param", f"x.{name}", 0, offset + lo, hi - lo))

    rng, rng_tensors = _rng_state()
    tensors.update(rng_tensors)
    slice_tensors, slice_entry = save_slice_states(engine)
    tensors.update(slice_tensors)
    state = engine.state_dict()
    rank_state = {
        slice_state.STATE_KEY: slice_entry,
        "rng": rng,
        "optimizer_step": sorted(steps),
        "param_groups": [
            {k: v for k, v in pg.items() if k != "params" and _jsonable(v)}
            for pg in engine.optimizer.param_groups
        ],
        "scaler": state["scaler"],
        "scheduler": state["scheduler"],
    }
    meta = {
        "tensors": meta_tensors,
        "aliases": aliases,
        "global_steps": state["global_steps"],
        "micro_steps": state["micro_steps"],
        "skipped_steps": state["skipped_steps"],
        "mesh": {
            "pp": topo.pp_size,
            "dp": topo.dp_size,
            "cp": topo.cp_size,
            "tp": topo.tp_size,
            "ep": topo.ep_size,
        },
        "zero_stage": engine.zero_stage,
        "precision": engine.config.precision,
        "config": engine.config.to_dict(derived=False),
        "data_loader": state["data_loader"],
        "client_state": client_state or {},
    }
    model = _unsplit_view(engine)
    hf = getattr(model, "config", None)
    if hasattr(hf, "to_dict") and hasattr(model, "save_pretrained"):
        meta["hf_config"] = hf.to_dict()
        meta["hf_model_class"] = type(model).__name__
    keep = engine.config.checkpoint.keep_last
    return tag, dict(
        group=world,
        tensors=tensors,
        pieces=pieces,
        rank_state=rank_state,
        meta=meta,
        keep_last=keep or None,
    )


def _unsplit_view(engine) -> torch.nn.Module:
    """The model (for its ``config``): under pp, a split stage's view of it."""
    if engine.pipeline is None:
        return engine.module
    stage = next(iter(engine.module.stages.values()))
    return getattr(stage, "model", stage)


def _frozen_specs(engine) -> dict[str, ShardSpec]:
    """State-dict keys of tensor-parallel shards that are not trainable (frozen)."""
    if engine.topology.tp_size == 1:
        return {}
    from meshtrain.parallel.tensor.sharding import tp_specs

    trainable = {id(p) for g in engine.zero.flat_groups for p in g.params}
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    return {k: s for k, s in tp_specs(engine.module).items() if id(params.get(k)) not in trainable}


def _agreed_tag(tag: str, world, config) -> str:
    """Rank 0's tag; ranks that passed another are handled by ``checkpoint.tag_validation``."""
    if world.size == 1 or world.pg is None:
        return tag
    import torch.distributed as dist

    tags: list[Any] = [None] * world.size
    dist.all_gather_object(tags, tag, group=world.pg)
    if len(set(tags)) == 1:
        return tag
    policy = config.checkpoint.tag_validation
    by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if policy == "Fail":
        raise CheckpointError(
            f"save_checkpoint: ranks passed different tags ({by_rank}); pass the same tag on "
            'every rank, or set checkpoint.tag_validation to "Warn" to save under rank 0\'s'
        )
    if policy == "Warn" and world.rank == 0:
        log.warning(
            "save_checkpoint: ranks passed different tags (%s); saving as %r", by_rank, tags[0]
        )
    return tags[0]


def _jsonable(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, (bool, int, float, str))
        or (isinstance(v, (list, tuple)) and all(_jsonable(x) for x in v))
    )


def load(
    engine,
    load_dir,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[Path | None, dict | None]:
    """``engine.load_checkpoint`` (see the module docstring); ``(None, None)`` when there
    is nothing to load."""
    reason = nothing_to_load(load_dir, tag)
    if reason is not None:
        if engine.topology.rank == 0:
            log.warning("load_checkpoint: %s; starting from the model as it is", reason)
        return None, None
    # closing unmaps the files: their touched pages would otherwise stay in this rank's RSS
    with CheckpointReader(load_dir, tag) as reader:
        return _load(
            engine, reader, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )


def nothing_to_load(load_dir, tag: str | None) -> str | None:
    """Why ``load_dir``/``tag`` holds no checkpoint (DeepSpeed then returns ``(None, None)``
    and the script starts fresh), or None when there is one to load. A directory with
    complete tags but no ``latest`` is not "nothing": the reader's error names the tags."""
    path = Path(load_dir)
    if not path.is_dir():
        return f"{path} does not exist"
    if tag is not None:
        primary, old = path / tag, path / f"{storage.OLD_PREFIX}{tag}"
        if not primary.exists() and not storage.is_complete(old):
            return f"{path} has no tag {tag!r} (complete tags: {storage.list_tags(path)})"
        return None
    if storage.is_complete(path) or storage.latest_tag(path) is not None:
        return None
    if not storage.list_tags(path):
        return f"{path} has no 'latest' file and no checkpoint tags"
    return None


def _load(
    engine,
    reader: CheckpointReader,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[Path, dict]:
    topo = engine.topology
    world = topo.group("world")
    names = model_names(engine)
    canon, aliases, meta_tensors = names.canon, names.aliases, names.tensors
    tp = _tp(engine)
    ep = experts.expert_specs(engine)
    reader.check_model(names.expected())
    meta = reader.meta
    states = [s for s in reader.states() if s != "param"] if load_optimizer_states else []
    if load_module_only:
        states = []
    rank0 = reader.rank_state(0)
    step_values = rank0.get("optimizer_step") or [0.0]
    # torch keeps ``step`` beside the parameters for fused/capturable kernels, else on the CPU
    fused = any(pg.get("fused") or pg.get("capturable") for pg in engine.optimizer.param_groups)
    read_into = getattr(reader, "read_into", None)
    with torch.no_grad():
        for g in engine.zero.flat_groups:
            mine = states if g.layout == "flat" else []  # the others: load_slice_states
            for b, master in zip(g.buckets, g.master_chunks, strict=True):
                lo, hi = g.owned_range(b)
                fresh = {s: torch.zeros_like(master) for s in mine}
                master.zero_()
                for name, start, local, n in _runs(g, b, lo, hi, canon, tp, False, ep):
                    dst = slice(local - lo, local - lo + n)
                    # a source that can (sliced_load's) reads straight into the master
                    if not (read_into and read_into(name, start, master[dst])):
                        master[dst] = reader.read(name, "param", start, n).to(master.dtype)
                    for s in mine:
                        fresh[s][dst] = reader.read(name, s, start, n).to(master.dtype)
                if mine:
                    dev = master.device if fused else "cpu"
                    step = torch.tensor(step_values[-1], dtype=torch.float32, device=dev)
                    g.set_optimizer_state(b, engine.optimizer.state, {"step": step, **fresh})
        if load_optimizer_states and not load_module_only:
            load_slice_states(engine, reader)
        engine.zero.reload_params()
        frozen_specs = _frozen_specs(engine)
        sharded = {id(p): g for g in engine.zero.frozen_groups for p in g.params}
        for key, t in engine.module.state_dict(keep_vars=True).items():
            name = canon[id(t)]
            if names.keys[key] in aliases or meta_tensors[name]["kind"] == "param":
                continue
            full = reader.read_full(name)
            if key in frozen_specs:
                full = shard_tensor(full, frozen_specs[key], topo.tp_rank)
            if ep is not None and id(t) in ep[0]:  # frozen experts: this ep rank's
                full = experts.local_experts(full, ep[0][id(t)], ep[1])
            if id(t) in sharded:  # ZeRO-3 frozen: write this rank's chunk of the shard
                sharded[id(t)].load_full(t, full)
            else:
                t.copy_(full.to(t.dtype))
    if load_module_only:
        return reader.path, meta.get("client_state", {})
    if load_optimizer_states:
        for pg, saved in zip(engine.optimizer.param_groups, rank0["param_groups"], strict=False):
            pg.update(
                {k: tuple(v) if isinstance(pg.get(k), tuple) else v for k, v in saved.items()}
            )
    engine.load_state_dict(
        {
            "global_steps": meta["global_steps"],
            "micro_steps": meta["micro_steps"],
            "skipped_steps": meta["skipped_steps"],
            "scaler": rank0["scaler"],
            "scheduler": rank0["scheduler"],
            "data_loader": meta.get("data_loader"),
        },
        load_lr_scheduler=load_lr_scheduler_states,
    )
    if reader.world_size == world.size:
        _set_rng(reader.rank_state(world.rank)["rng"], reader, world.rank)
    return reader.path, meta.get("client_state", {})
