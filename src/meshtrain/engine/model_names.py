"""The names a rank's tensors have in a checkpoint: always the *unsplit* model's.

Without pipeline parallelism ``engine.module`` is the model and its state-dict keys are
the names. With ``pp > 1`` it is ``PipelineStages`` (keys ``stages.<k>.<stage key>``), and
each stage maps its keys back with ``model_key``:

* an automatically split model (``SplitStage``): the model's own keys, blocks renumbered
  back (stage 1's ``layers.0.w`` is the model's ``layers.4.w``);
* a ``meshtrain.pipe.PipelineModule`` (``_Stage``): ``layers.<i>.<w>`` with ``i`` the
  layer's index in the ``layers=[...]`` list, and ``tied_modules.<key>.<w>`` for a
  ``TiedLayerSpec`` -- names that do not depend on how the list is cut.

A tensor's *canonical* name is the unsplit model's first name for it (a tied weight
has one canonical name, e.g. ``embed.weight``; its other keys, ``lm_head.weight``, are
aliases). Under pp each rank knows only its stages' tensors, so the whole model's table
(``tensors``, ``aliases``) is gathered over the pp group: one ``all_gather_object`` of
the name/shape/dtype table (JSON-sized, no tensor data). A tensor several pp ranks hold
(a tied embedding, a buffer of a module every stage shares) is **owned** by the lowest
pp rank holding it: only its owner writes it, so it is saved once.

``full_state_dict``: ``engine.module_state_dict()`` under pp. Every tensor of the whole
model is broadcast over the pp group from its owner, one broadcast per tensor (its
bytes once per pp rank); every rank gets the unsplit model's state dict, aliases included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.checkpoint.manifest import dtype_from_name, dtype_name
from meshtrain.engine.engine_view import EngineView
from meshtrain.engine.expert_layout import expert_specs
from meshtrain.parallel.tensor.sharding import full_shape, specs_by_param


@dataclass
class ModelNames:
    """This rank's tensors in the unsplit model's names, and the whole model's table."""

    canon: dict[int, str]  # id(tensor) -> canonical name
    keys: dict[str, str]  # engine.module state-dict key -> the unsplit model's key
    tensors: dict[str, dict[str, Any]]  # whole model: canonical name -> shape, dtype, kind
    aliases: dict[str, str]  # whole model: alias key -> canonical name
    owner: dict[str, int] = field(default_factory=dict)  # canonical name -> owning pp rank
    order: list[str] = field(default_factory=list)  # whole model's keys, stage by stage
    _placed: list[tuple[int, int, str]] = field(default_factory=list, repr=False)

    def writes(self, name: str, pp_rank: int) -> bool:
        """Whether this pp rank writes ``name`` (a tensor held by several is written once)."""
        return self.owner.get(name, pp_rank) == pp_rank

    def expected(self) -> dict[str, tuple[int, ...]]:
        """``{key: shape}`` of the whole model, aliases included (``check_model``'s input)."""
        out = {k: tuple(v["shape"]) for k, v in self.tensors.items()}
        out.update({a: out[c] for a, c in self.aliases.items()})
        return out


def _key_map(module: torch.nn.Module, pipelined: bool) -> dict[str, str]:
    keys = list(module.state_dict(keep_vars=True))
    if not pipelined:
        return {k: k for k in keys}
    out = {}
    for key in keys:
        _, k, rest = key.split(".", 2)  # stages.<k>.<stage key>
        out[key] = module.stages[k].model_key(rest)
    return out


def _local(engine: EngineView) -> ModelNames:
    """This rank's names and its own part of the table (no communication)."""
    module, pipelined = engine.module, engine.pipeline is not None
    keys = _key_map(module, pipelined)
    canon: dict[int, str] = {}
    if pipelined:  # stages know the unsplit model's first name of each parameter
        for stage in module.stages.values():
            for name, p in stage.names.items():
                canon.setdefault(id(p), name)
    else:
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            canon.setdefault(id(t), name)
    state = module.state_dict(keep_vars=True)
    for key, t in state.items():
        canon.setdefault(id(t), keys[key])
    trainable = {p: s for g in engine.zero.flat_groups for p, s in g.shapes.items()}
    frozen = {p: s for g in engine.zero.frozen_groups for p, s in g.shapes.items()}
    shapes = {**trainable, **frozen}  # ZeRO-3 frozen shards: placeholders hold no shape
    specs = specs_by_param(module) if engine.topology.tp_size > 1 else {}
    experts = expert_specs(engine)  # an ep rank's experts: the checkpoint holds all E
    specs.update(experts[0] if experts else {})
    tensors: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    placed: dict[str, tuple[int, int, str]] = {}  # model key -> (stage, position, key)
    for i, (key, t) in enumerate(state.items()):
        name, mkey = canon[id(t)], keys[key]
        stage = int(key.split(".", 2)[1]) if pipelined else 0
        placed.setdefault(mkey, (stage, i, mkey))
        if mkey != name:
            aliases[mkey] = name
        if name in tensors:
            continue
        kind = (
            "param"
            if t in trainable
            else "frozen"
            if isinstance(t, torch.nn.Parameter)
            else "buffer"
        )
        shape = shapes.get(t, t.shape)
        if id(t) in specs:  # a tp shard or an ep rank's experts: the checkpoint holds all
            shape = full_shape(tuple(shape), specs[id(t)])
        tensors[name] = {"shape": list(shape), "dtype": dtype_name(t.dtype), "kind": kind}
    places = sorted(placed.values())
    return ModelNames(canon, keys, tensors, aliases, order=[k for *_, k in places], _placed=places)


def model_names(engine: EngineView) -> ModelNames:
    """``_local`` merged over the pp group (collective when pp > 1: every rank calls it)."""
    names = _local(engine)
    pp = engine.topology.pp_group
    if engine.pipeline is None or pp.size == 1:
        return names
    import torch.distributed as dist

    tables: list[Any] = [None] * pp.size
    mine = (names.tensors, names.aliases, names._placed)
    dist.all_gather_object(tables, mine, group=pp.pg)
    tensors: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    owner: dict[str, int] = {}
    first: dict[str, tuple[int, int, str]] = {}
    for r, (t, a, placed) in enumerate(tables):  # pp rank order: the lowest holder owns
        for name, spec in t.items():
            tensors.setdefault(name, spec)
            owner.setdefault(name, r)
        # canonical names come from stage.names on every rank, so a key that is canonical
        # on one rank is never an alias on another
        aliases.update(a)
        for place in placed:  # the key's first stage decides where it goes in the order
            if place[2] not in first or place < first[place[2]]:
                first[place[2]] = place
    order = [k for *_, k in sorted(first.values())]
    return ModelNames(names.canon, names.keys, tensors, aliases, owner, order)


def full_state_dict(engine: EngineView) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict on every rank (see the module docstring)."""
    from meshtrain.distributed import comm

    names = model_names(engine)
    pp = engine.topology.pp_group
    mine: dict[str, torch.Tensor] = {}
    state = engine.module.state_dict(keep_vars=True)
    whole = None  # under tp a stage holds shards: gathered over tp before going over pp
    if engine.topology.tp_size > 1:
        from meshtrain.parallel.tensor.sharding import full_state_dict as tp_whole

        whole = tp_whole(engine.module, engine.topology.tp_group)
    for key, t in state.items():
        mine.setdefault(names.canon[id(t)], t.detach() if whole is None else whole[key])
    full: dict[str, torch.Tensor] = {}
    device = engine.topology.device
    for name in sorted(names.tensors):  # one order on every rank
        spec = names.tensors[name]
        src = names.owner.get(name, 0)
        if pp.rank == src:
            buf = mine[name].clone()
        else:
            buf = torch.empty(spec["shape"], dtype=dtype_from_name(spec["dtype"]), device=device)
        comm.broadcast(buf, src=src, group=pp, label="checkpoint")
        full[name] = buf
    return {k: full[names.aliases.get(k, k)] for k in names.order}
