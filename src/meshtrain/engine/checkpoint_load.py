"""``engine.load_checkpoint``: each rank asks a *source* for exactly the element ranges
it owns in its own layout (``checkpoint_layout.py``), whatever layout wrote them. The
source is a ``checkpoint.CheckpointReader`` for meshtrain's own format, or any object
with its reading methods (``read``, ``read_full``, ``check_model``, ``states``,
``rank_state``, ``meta``, ``world_size``; ``read_into`` optionally): the safetensors
folders of ``interop.from_pretrained`` and the peer formats of ``interop``."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from meshtrain.checkpoint import storage
from meshtrain.checkpoint.reader import CheckpointReader
from meshtrain.engine import expert_layout as experts
from meshtrain.engine.checkpoint_layout import frozen_specs, runs, tp_of
from meshtrain.engine.engine_view import EngineView
from meshtrain.engine.model_names import model_names
from meshtrain.engine.rng_state import set_rng
from meshtrain.engine.slice_state import load_slice_states
from meshtrain.interop.peer_checkpoints import open_peer_checkpoint
from meshtrain.parallel.tensor.sharding import shard_tensor

log = logging.getLogger("meshtrain")


def load(
    engine: EngineView,
    load_dir,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[Path | None, dict | None]:
    """``engine.load_checkpoint`` (see the module docstring); ``(None, None)`` when there
    is nothing to load. ``load_dir`` is a folder (meshtrain's format, or a peer's:
    ``interop.peer_checkpoints``) or an opened source."""
    if hasattr(load_dir, "check_model"):  # an opened source (from_pretrained's folder)
        return load_from(
            engine, load_dir, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )
    peer = open_peer_checkpoint(load_dir, tag)
    if peer is not None:  # closing unmaps the peer's files, as the reader does below
        with peer:
            return load_from(
                engine, peer, load_optimizer_states, load_lr_scheduler_states, load_module_only
            )
    reason = nothing_to_load(load_dir, tag)
    if reason is not None:
        if engine.topology.rank == 0:
            log.warning("load_checkpoint: %s; starting from the model as it is", reason)
        return None, None
    # closing unmaps the files: their touched pages would otherwise stay in this rank's RSS
    with CheckpointReader(load_dir, tag) as reader:
        return load_from(
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


def load_from(
    engine: EngineView,
    reader: CheckpointReader,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[Path, dict]:
    topo = engine.topology
    world = topo.group("world")
    names = model_names(engine)
    canon, aliases, meta_tensors = names.canon, names.aliases, names.tensors
    tp = tp_of(engine)
    ep = experts.expert_specs(engine)
    if hasattr(reader, "use_aliases"):  # a peer's source: it resolves tied names itself
        reader.use_aliases(names.aliases)
    if hasattr(reader, "use_model"):  # a peer keying its optimizer by parameter order
        reader.use_model(engine.module if engine.pipeline is None else None)
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
                for name, start, local, n in runs(g, b, lo, hi, canon, tp, False, ep):
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
        frozen = frozen_specs(engine)
        sharded = {id(p): g for g in engine.zero.frozen_groups for p in g.params}
        for key, t in engine.module.state_dict(keep_vars=True).items():
            name = canon[id(t)]
            if names.keys[key] in aliases or meta_tensors[name]["kind"] == "param":
                continue
            full = reader.read_full(name)
            if key in frozen:
                full = shard_tensor(full, frozen[key], topo.tp_rank)
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
            # a peer that keeps no micro-step count (DeepSpeed): whole steps of this run's gas
            "micro_steps": meta["micro_steps"]
            if meta.get("micro_steps") is not None
            else meta["global_steps"] * engine.gas,
            "skipped_steps": meta["skipped_steps"],
            "scaler": rank0["scaler"],
            "scheduler": rank0["scheduler"],
            "data_loader": meta.get("data_loader"),
        },
        load_lr_scheduler=load_lr_scheduler_states,
    )
    if reader.world_size == world.size:
        set_rng(reader.rank_state(world.rank)["rng"], reader, world.rank)
    return reader.path, meta.get("client_state", {})
