"""Optimizer states that are not element-wise, saved as the optimizer holds them.

Element-wise states (Adam's moments, Lion's momentum) are written as pieces over each
parameter's flattened index (``checkpoint_layout.py``), which is why a checkpoint loads at any
data-parallel size or ZeRO stage. Two kinds of state cannot be cut that way:

* blockwise 8-bit states (bitsandbytes AdamW8bit, Lion8bit: ``state1``/``state2`` bytes
  with one ``absmax`` per 256 elements and a 256-entry ``qmap``), on the ``"blocks"``
  master layout;
* Adafactor's factored second moment (a row and a column vector per matrix), on the
  ``"whole"`` layout.

They are saved per rank, slice by slice, exactly as the optimizer holds them (dtype and
shape kept: the 8-bit bytes stay bytes), with a *fingerprint* of the layout that wrote
them: the world size and, per flat group of such a layout, its slices' shapes. A load at
the same layout restores them bit for bit, so a resumed run continues identically. A load
at another layout (another world size, ZeRO stage or bucket size) cannot place them and
says so, naming ``load_optimizer_states=False``, which keeps the weights (they are
layout-free as always) and starts the optimizer state fresh. Under stage 0 every rank
holds the whole state and writes its own copy.
"""

from __future__ import annotations

import torch

from meshtrain.engine.engine_view import EngineView
from meshtrain.errors import CheckpointError

STATE_KEY = "slice_state"


def _layout_groups(engine: EngineView):
    """``(group index, FlatGroup)`` of every group whose layout is not element-wise."""
    return [(gi, g) for gi, g in enumerate(engine.zero.flat_groups) if g.layout != "flat"]


def _fingerprint(engine: EngineView) -> list:
    return [
        [gi, g.layout, [[list(m.shape) for m in slices] for slices in g.master_slices]]
        for gi, g in _layout_groups(engine)
    ]


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def save_slice_states(engine: EngineView) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors for this rank's file, the rank-state entry) of the non-element-wise
    optimizer states; empty when every group is element-wise."""
    groups = _layout_groups(engine)
    if not groups:
        return {}, {}
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict] = {}
    shared: dict[str, str] = {}  # bitsandbytes shares one qmap between all its states
    first: dict[tuple, str] = {}
    state = engine.optimizer.state
    for gi, g in groups:
        for bi, slices in enumerate(g.master_slices):
            for si, m in enumerate(slices):
                for k, v in state.get(m, {}).items():
                    key = f"opt.g{gi}.b{bi}.s{si}.{k}"
                    if isinstance(v, torch.Tensor):
                        ident = (v.data_ptr(), v.dtype, tuple(v.shape), v.device)
                        if ident in first:
                            shared[key] = first[ident]
                        else:
                            first[ident] = key
                            tensors[key] = v.detach().cpu().contiguous()
                    elif _jsonable(v):
                        values[key] = v
                    else:
                        raise CheckpointError(
                            f"optimizer.type {engine.config.optimizer.type}: state {k!r} is a "
                            f"{type(v).__name__}, which a checkpoint cannot hold; save with "
                            "an element-wise optimizer (AdamW, Lion) or export the weights"
                        )
    return tensors, {"fingerprint": _fingerprint(engine), "values": values, "shared": shared}


def load_slice_states(engine: EngineView, reader) -> None:
    """Restore what ``save_slice_states`` wrote, at the same layout only (module docstring)."""
    groups = _layout_groups(engine)
    if not groups:
        return
    world = engine.topology.group("world")
    kind = engine.config.optimizer.type
    fix = (
        "load at the layout that saved it, or pass load_optimizer_states=False to keep the "
        "weights and start the optimizer state fresh"
    )
    if reader.world_size != world.size:
        raise CheckpointError(
            f"{reader.path}: the {kind} optimizer state is bound to the layout that saved it "
            f"({reader.world_size} ranks; this run has {world.size}); {fix}"
        )
    saved = reader.rank_state(world.rank).get(STATE_KEY)
    if not saved:
        raise CheckpointError(
            f"{reader.path}: no {kind} optimizer state was saved (the checkpoint was written "
            f"with an element-wise optimizer); {fix}"
        )
    if saved["fingerprint"] != _fingerprint(engine):
        raise CheckpointError(
            f"{reader.path}: the {kind} optimizer state was saved by another layout (ZeRO "
            "stage, bucket size or parameter groups differ from this run's); " + fix
        )
    keys = set(reader.rank_keys(world.rank))
    values, shared = saved["values"], saved.get("shared", {})
    loaded: dict[str, torch.Tensor] = {}

    def tensor(key: str, device) -> torch.Tensor:
        key = shared.get(key, key)  # shared when saved: shared again
        if key not in loaded:
            loaded[key] = reader.rank_tensor(world.rank, key).to(device)
        return loaded[key]

    state = engine.optimizer.state
    for gi, g in groups:
        for bi, slices in enumerate(g.master_slices):
            for si, m in enumerate(slices):
                prefix = f"opt.g{gi}.b{bi}.s{si}."
                entry = {
                    k[len(prefix) :]: tensor(k, m.device)
                    for k in [*keys, *shared]
                    if k.startswith(prefix)
                }
                entry.update(
                    {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
                )
                if entry:
                    state[m] = entry
                else:
                    state.pop(m, None)


__all__ = ["load_slice_states", "save_slice_states"]
