"""``engine.save_checkpoint``: this rank's part of a checkpoint (its pieces of the fp32
masters and optimizer states, frozen tensors, the rank state and the meta), written by
``checkpoint.save_shards`` now or by the background saver, or with ``checkpoint.format:
dcp`` as a torch.distributed.checkpoint folder (``interop.dcp_writer``, from the same
pieces). Where each element goes: ``checkpoint_layout.py``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint.manifest import Piece
from meshtrain.checkpoint.writer import save_shards
from meshtrain.engine import expert_layout as experts
from meshtrain.engine import slice_state
from meshtrain.engine.checkpoint_layout import frozen_specs, runs, save_range, tp_of, unsplit_view
from meshtrain.engine.engine_view import EngineView
from meshtrain.engine.model_names import model_names
from meshtrain.engine.rng_state import rng_state
from meshtrain.engine.slice_state import save_slice_states
from meshtrain.errors import CheckpointError
from meshtrain.interop.dcp_writer import save_dcp
from meshtrain.parallel.tensor.sharding import unshard_tensor
from meshtrain.parallel.zero.frozen import whole_state_items

log = logging.getLogger("meshtrain")


def save(
    engine: EngineView,
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
    engine.wait_for_checkpoint()  # a second save waits for the first (and raises its failure)
    tag, args = shard_contents(engine, tag, client_state)
    if engine.config.checkpoint.format == "dcp":
        if engine.config.checkpoint.async_save:
            raise CheckpointError(
                "checkpoint.format dcp is written synchronously: checkpoint.async_save is "
                "not supported with it yet; set async_save false or format meshtrain"
            )
        path = save_dcp(save_dir, tag, group_of=param_groups_of(engine), **args)
        if on_commit is not None:
            on_commit(path)
        return path
    if engine.config.checkpoint.async_save:
        engine.async_saver().submit(
            save_shards, save_dir=save_dir, tag=tag, on_commit=on_commit, **args
        )
        return Path(save_dir) / tag
    path = save_shards(save_dir, tag, **args)
    if on_commit is not None:
        on_commit(path)
    return path


def shard_contents(
    engine: EngineView, tag: str | None, client_state: dict | None
) -> tuple[str, dict]:
    """(the agreed tag, ``save_shards`` keyword arguments) of this rank's part of a save:
    ``tensors`` (views of the live state where they can be: copy them before training on),
    ``pieces``, ``rank_state``, ``meta``, ``group``, ``keep_last``. A collective (the tag)."""
    topo = engine.topology
    world = topo.group("world")
    tag = agreed_tag(tag or f"global_step{engine.global_steps}", world, engine.config)
    names = model_names(engine)
    tensors, pieces, steps = state_pieces(engine, names, with_optimizer=True)
    aliases, meta_tensors = names.aliases, names.tensors

    rng, rng_tensors = rng_state()
    tensors.update(rng_tensors)
    slice_tensors, slice_entry = save_slice_states(engine)
    tensors.update(slice_tensors)
    state = engine.state_dict()
    rank_state = {
        slice_state.STATE_KEY: slice_entry,
        "rng": rng,
        "optimizer_step": sorted(steps),
        "param_groups": [
            {k: v for k, v in pg.items() if k != "params" and jsonable(v)}
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
    model = unsplit_view(engine)
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


def state_pieces(engine: EngineView, names, with_optimizer: bool) -> tuple[dict, list[Piece], set]:
    """This rank's share of the model (and, ``with_optimizer``, of AdamW's element-wise
    states): ``(tensors, pieces, steps)``. ``tensors`` are 1-D CPU views of the live fp32
    masters where they can be (copies of frozen tensors and buffers); ``pieces`` place them
    in the unsplit model's flattened tensors; ``steps`` the optimizer's step counts. Over
    all ranks the pieces of one state tile each tensor exactly once (replicas split what
    they share). A collective (frozen tensor-parallel shards and ZeRO-3 frozen tensors are
    made whole), so every rank calls it in the same order."""
    topo = engine.topology
    replicas = topo.replica_group  # dp x cp hold the same weights: each writes its share
    canon, aliases, meta_tensors = names.canon, names.aliases, names.tensors
    tp = tp_of(engine)
    ep = experts.expert_specs(engine)
    writers = experts.stage0_writers(engine)
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[Piece] = []
    steps = set()
    opt_state = engine.optimizer.state
    for gi, g in enumerate(engine.zero.flat_groups):
        for b, master in zip(g.buckets, g.master_chunks, strict=True):
            lo, hi, base = save_range(g, b, *writers[id(g)])
            if hi <= lo:
                continue
            sources = {"param": master.detach()}
            # element-wise states as pieces; the others per rank (``slice_state``)
            joined = (
                g.optimizer_state(b, opt_state) if with_optimizer and g.layout == "flat" else {}
            )
            for k, v in joined.items():  # joined over its slices
                if isinstance(v, torch.Tensor) and v.shape == master.shape:
                    sources[k] = v
                elif k == "step":
                    steps.add(float(v))
            for state, src in sources.items():
                key = f"g{gi}.b{b.index}.{state}"
                tensors[key] = src[lo - base : hi - base].detach().float().cpu().contiguous()
                for name, start, local, n in runs(g, b, lo, hi, canon, tp, True, ep):
                    if names.writes(name, topo.pp_rank):  # a tied weight: its first stage
                        pieces.append(Piece(name, state, key, local - lo, start, n))
    frozen = frozen_specs(engine)
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
        if key in frozen:  # a frozen tensor-parallel shard: write the full tensor
            t = unshard_tensor(t, frozen[key], topo.tp_group)
        flat = t.reshape(-1)
        n_share, n_part, offset = experts.frozen_split(engine, ep, t, key, share, part)
        c = -(-flat.numel() // n_share)
        lo, hi = min(n_part * c, flat.numel()), min((n_part + 1) * c, flat.numel())
        if hi > lo:
            chunk = flat[lo:hi].cpu().contiguous()
            tensors[f"x.{name}"] = chunk.clone() if gathered else chunk
            pieces.append(Piece(name, "param", f"x.{name}", 0, offset + lo, hi - lo))
    return tensors, pieces, steps


def param_groups_of(engine: EngineView) -> dict[str, int]:
    """Each trainable parameter's optimizer param group, by its checkpoint name."""
    canon = model_names(engine).canon
    return {
        canon[id(p)]: i
        for i, flat_groups in enumerate(engine.zero.per_group)
        for g in flat_groups
        for p in g.shapes
    }


def agreed_tag(tag: str, world, config) -> str:
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


def jsonable(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, (bool, int, float, str))
        or (isinstance(v, (list, tuple)) and all(jsonable(x) for x in v))
    )
