"""Writing a torch.distributed.checkpoint (DCP) folder from the ranks (``checkpoint.format:
dcp``), in torchtitan's keys, which torch's own ``dcp.load`` reads into FSDP2.

What each rank writes is what it writes for meshtrain's own format (``engine
.checkpoint_save.shard_contents``): its pieces, each a run ``[start, start + n)`` of one
tensor's flattened index, of the fp32 masters, AdamW's ``exp_avg`` / ``exp_avg_sq``,
frozen tensors and buffers. DCP describes a tensor's chunks as boxes of its global shape,
so a run is cut into the boxes that tile it in row-major order (:func:`flat_boxes`: a
part of a first row, whole rows, a part of a last row, recursively for more dimensions;
at most ``2 d - 1`` boxes for a ``d``-dimensional tensor) and each box is one chunk.
torch's loader reads any tiling of boxes into any target layout (FSDP2's ``Shard(0)``
rows, tensor-parallel columns), so nothing is gathered: no rank ever holds more than its
own pieces and one chunk being serialised.

Keys (torchtitan's ``CheckpointManager``: the model flattened to the top, the rest not):

* the model's state-dict keys (tied aliases included, pointing at the same bytes);
* ``optimizer.state.<fqn>.exp_avg`` / ``exp_avg_sq`` / ``step`` and
  ``optimizer.param_groups.<fqn>.<hyper-parameter>``, as
  ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` names them;
* ``train_state.step`` (the engine's step count) and, with a scheduler,
  ``lr_scheduler.last_epoch`` (torch's count of ``step()`` calls: meshtrain's
  ``last_batch_iteration + 1``).

Files: each rank ``__<rank>_0.distcp`` (DCP's own names: every chunk one ``torch.save``
archive, end to end), rank 0 also the replicated steps and the pickled values; then rank 0
writes ``.metadata`` (torch's ``Metadata``, pickled with torch's classes, as
``FileSystemWriter.finish`` does). Atomic as meshtrain's own saves: everything goes into
``.tmp-<tag>/``, renamed to ``<tag>`` once ``.metadata`` is durable, then ``latest`` is
replaced. Collectives: two ``all_gather_object`` of statuses and one of each rank's chunk
table (a few hundred bytes per chunk); bytes written: the state once over all ranks.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint.manifest import LATEST, OLD_PREFIX, TMP_PREFIX, check_tag
from meshtrain.errors import CheckpointError
from meshtrain.files.atomic import fsync_dir, write_atomic
from meshtrain.interop.dcp_metadata import METADATA
from meshtrain.interop.dcp_source import TRAIN_STEP_KEY, is_dcp_folder

log = logging.getLogger("meshtrain")

OPTIM = "optimizer"
DCP_VERSION = "1.0.0"  # torch 2.x FileSystemWriter's CURRENT_DCP_VERSION


def flat_boxes(shape, start: int, end: int):
    """``(offsets, sizes, first)`` of the boxes that tile elements ``[start, end)`` of a
    row-major tensor of ``shape``, in order; ``first`` is a box's first flat element."""
    shape = tuple(int(d) for d in shape)
    if start >= end:
        return
    if not shape:
        yield (), (), start
        return
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    zeros = (0,) * (len(shape) - 1)
    if r0 == r1:  # within one row: that row's sub-boxes
        for off, size, first in flat_boxes(shape[1:], c0, c1):
            yield (r0, *off), (1, *size), r0 * inner + first
        return
    if c0:
        for off, size, first in flat_boxes(shape[1:], c0, inner):
            yield (r0, *off), (1, *size), r0 * inner + first
        r0 += 1
    if r1 > r0:
        yield (r0, *zeros), (r1 - r0, *shape[1:]), r0 * inner
    if c1:
        for off, size, first in flat_boxes(shape[1:], 0, c1):
            yield (r1, *off), (1, *size), r1 * inner + first


def _exchange(group, obj: Any) -> list[Any]:
    if group is None or group.size == 1 or group.pg is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def _raise_first(statuses: list[str | None], what: str) -> None:
    for rank, err in enumerate(statuses):
        if err:
            raise CheckpointError(f"DCP save, {what}: rank {rank}: {err}")


def _items(tensors, pieces, meta, rank_state, group_of, rank: int):
    """(key, data, chunk offsets or None for a pickled value) this rank writes."""
    shapes = {n: t["shape"] for n, t in meta["tensors"].items()}
    for p in pieces:
        if not p.numel:
            continue
        key = p.name if p.state == "param" else f"{OPTIM}.state.{p.name}.{p.state}"
        src = tensors[p.key].reshape(-1)[p.offset : p.offset + p.numel]
        for off, size, first in flat_boxes(shapes[p.name], p.start, p.start + p.numel):
            n = math.prod(size)
            # a clone: torch.save of a view would write the whole storage it views
            yield key, src[first - p.start : first - p.start + n].reshape(size).clone(), off
    if rank != 0:
        return
    steps = rank_state.get("optimizer_step") or []
    groups = rank_state.get("param_groups") or []
    trainable = [n for n, t in meta["tensors"].items() if t["kind"] == "param"]
    if steps:  # replicated values: written once
        for name in trainable:
            yield f"{OPTIM}.state.{name}.step", torch.tensor(float(steps[-1])), ()
    for name in trainable:
        group = groups[group_of.get(name, 0)] if groups else {}
        for k, v in group.items():
            yield f"{OPTIM}.param_groups.{name}.{k}", tuple(v) if k == "betas" else v, None
    yield TRAIN_STEP_KEY, int(meta["global_steps"]), None
    scheduler = rank_state.get("scheduler")
    if scheduler and "last_batch_iteration" in scheduler:
        yield "lr_scheduler.last_epoch", int(scheduler["last_batch_iteration"]) + 1, None


def _write_rank_file(tmp: Path, rank: int, items) -> list[tuple]:
    """This rank's ``.distcp``; returns its chunk table (key, offsets, sizes, dtype,
    file, byte offset, byte length), ``offsets`` None for a pickled value."""
    rel = f"__{rank}_0.distcp"
    table = []
    with open(tmp / rel, "wb") as f:
        for key, data, off in items:
            start = f.tell()
            if off is None:
                buf = io.BytesIO()
                torch.save(data, buf)
                f.write(buf.getbuffer())
                table.append((key, None, None, None, rel, start, f.tell() - start))
            else:
                torch.save(data, f)
                size = tuple(data.shape)
                table.append((key, off, size, str(data.dtype), rel, start, f.tell() - start))
        f.flush()
        os.fsync(f.fileno())
    return table


def _metadata(tables: list[list[tuple]], meta: dict, folder: Path):
    """torch's ``Metadata`` of the gathered chunk tables."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # DCP's own record
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    shapes = {n: tuple(t["shape"]) for n, t in meta["tensors"].items()}
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    volume: dict[str, int] = {}
    for table in tables:
        for key, off, size, dtype, rel, start, length in table:
            info = _StorageInfo(relative_path=rel, offset=start, length=length)
            top = key.split(".", 1)[0]
            planner[key] = (
                (key,)
                if top not in (OPTIM, "train_state", "lr_scheduler")
                else (top, key[len(top) + 1 :])
            )
            if off is None:
                entries[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = info
                continue
            name = key if key in shapes else key.rsplit(".", 1)[0].split(".", 2)[-1]
            full = () if key.endswith(".step") and key.startswith(OPTIM) else shapes[name]
            entry = entries.get(key)
            if entry is None:
                props = TensorProperties(dtype=getattr(torch, dtype.removeprefix("torch.")))
                entry = entries[key] = TensorStorageMetadata(props, torch.Size(full), [])
            entry.chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
            storage[MetadataIndex(key, off)] = info
            volume[key] = volume.get(key, 0) + math.prod(size)
    for key, entry in entries.items():  # an engine bug would leave a hole: never write it
        if isinstance(entry, TensorStorageMetadata) and volume[key] != math.prod(entry.size):
            raise CheckpointError(
                f"DCP save: the chunks of {key!r} cover {volume[key]} of "
                f"{math.prod(entry.size)} elements; this is a meshtrain bug: please report it"
            )
    for alias, canon in (meta.get("aliases") or {}).items():  # tied keys: the same bytes
        if canon in entries:
            entries[alias] = entries[canon]
            planner[alias] = (alias,)
            for index, info in list(storage.items()):
                if index.fqn == canon:
                    storage[MetadataIndex(alias, index.offset)] = info
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(folder), save_id=str(uuid.uuid4())),
        version=DCP_VERSION,
    )


def _commit(save_dir: Path, tag: str, tmp: Path, metadata) -> None:
    with open(tmp / METADATA, "wb") as f:
        pickle.dump(metadata, f)  # torch's own format: torch's reader unpickles it
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    final, old = save_dir / tag, None
    if final.exists():
        old = save_dir / f"{OLD_PREFIX}{tag}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old)
    write_atomic(save_dir / LATEST, tag)


def save_dcp(
    save_dir,
    tag: str,
    *,
    group,
    tensors: dict[str, torch.Tensor],
    pieces,
    rank_state: dict,
    meta: dict,
    group_of: dict[str, int],
    keep_last: int | None = None,
    **_: Any,
) -> Path:
    """Write this rank's part of the DCP checkpoint ``save_dir/tag`` (module docstring);
    every rank calls it with ``shard_contents``' arguments and ``group_of`` (parameter ->
    its optimizer param group). Returns ``save_dir/tag`` once ``latest`` names it."""
    save_dir = Path(save_dir)
    rank = 0 if group is None else group.rank
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    err = None
    if rank == 0:
        try:
            check_tag(tag)
            save_dir.mkdir(parents=True, exist_ok=True)
            final = save_dir / tag
            if final.exists() and not is_dcp_folder(final):
                raise CheckpointError(
                    f"{final} exists and is not a DCP checkpoint; move it away or save "
                    "under another tag"
                )
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except (OSError, CheckpointError) as exc:
            err = str(exc)
    _raise_first(_exchange(group, err), f"preparing {save_dir / tag}")
    table, err = [], None
    try:
        items = _items(tensors, pieces, meta, rank_state, group_of, rank)
        table = _write_rank_file(tmp, rank, items)
    except (OSError, RuntimeError, CheckpointError) as exc:
        err = f"{type(exc).__name__}: {exc}"
    gathered = _exchange(group, (table, err))
    if rank == 0 and any(e for _, e in gathered):
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_first([e for _, e in gathered], f"writing into {tmp}")
    err = None
    if rank == 0:
        try:
            _commit(save_dir, tag, tmp, _metadata([t for t, _ in gathered], meta, save_dir / tag))
        except (OSError, CheckpointError) as exc:
            err = str(exc)
            shutil.rmtree(tmp, ignore_errors=True)
        if keep_last and err is None:
            log.warning(
                "checkpoint.keep_last is not applied to DCP saves (%s keeps every tag)",
                save_dir,
            )
    _raise_first(_exchange(group, err)[:1], f"committing {save_dir / tag}")
    return save_dir / tag


__all__ = ["flat_boxes", "save_dcp"]
