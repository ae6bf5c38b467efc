"""Writing one checkpoint: every rank its own shard, in parallel, committed atomically.

Protocol (``save_dir`` must be one filesystem every rank sees, e.g. NFS/Lustre/local disk
on one node):

1. prepare -- rank 0 creates ``save_dir/.tmp-<tag>/`` (removing a stale one from an
   earlier crash); every rank checks its own inputs. Errors are exchanged, so one rank's
   bad input raises on every rank instead of leaving the others waiting in a collective.
2. write -- each rank writes ``.tmp-<tag>/rank{r:05d}.safetensors`` with safetensors,
   fsyncs it; its per-tensor xxh3-64 checksums come from the tensors it was written from
   (``tensor_files``), hashed while the fsync waits, so the file is never read back
   (phase ``"shard_written"``).
3. gather -- (file, size, checksums, pieces, rank_state) of every rank go to rank 0 through
   ``all_gather_object`` on the group (small metadata in memory; tensors never move).
4. commit (rank 0) -- check that the pieces tile every tensor, write ``manifest.json``
   (sealed with its own checksum, ``files.checksums.seal``) and fsync it (``"manifest_written"``); if ``<tag>`` exists, rename it to ``.old-<tag>``
   (``"moved_aside"``); rename ``.tmp-<tag>`` to ``<tag>`` and fsync save_dir
   (``"renamed"``); delete ``.old-<tag>``; replace ``latest`` atomically
   (``"latest_written"``); apply retention.
5. every rank learns rank 0's outcome, so ``save_shards`` returns (or raises) everywhere.

What a crash (SIGKILL, power loss) leaves, by the last phase reached:

==================  =========================================================
phase reached       ``latest`` names / loads
==================  =========================================================
(before any)        the previous tag
shard_written       the previous tag (``.tmp-<tag>`` is junk, removed by the
                    next save of that tag)
manifest_written    the previous tag
moved_aside         the previous tag; if that *is* the tag being overwritten,
                    readers load its old content from ``.old-<tag>``
renamed             the previous tag (``<tag>`` is complete and listed, but not
                    ``latest``)
latest_written      the new tag
==================  =========================================================

Collectives: three ``all_gather_object`` calls of a few KB per rank (status, file info,
commit status); bytes written: each rank its own shard, rank 0 also the manifest.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.checkpoint import storage, tensor_files
from meshtrain.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    OLD_PREFIX,
    TMP_PREFIX,
    Piece,
    build_manifest,
    check_json,
    check_meta,
    check_tag,
    dtype_name,
    dumps,
    parse_manifest,
    rank_file,
)
from meshtrain.distributed.comm import Group
from meshtrain.dtypes import BY_MANIFEST_NAME
from meshtrain.errors import CheckpointError
from meshtrain.files import checksums
from meshtrain.files.atomic import fsync_dir, write_atomic
from meshtrain.files.writable import check_writable

PHASES = ("shard_written", "manifest_written", "moved_aside", "renamed", "latest_written")


class _Channel:
    """Status and metadata exchange over ``group``; ``None`` means a world of one process
    without torch.distributed (offline conversion, tests): the same protocol, no transport."""

    def __init__(self, group: Group | None) -> None:
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
            return
        if not dist.is_initialized():
            raise CheckpointError(
                "save_shards got a group but torch.distributed is not initialized; call "
                "meshtrain.init_distributed() first, or pass group=None for one process"
            )
        if group.size != dist.get_world_size():
            raise CheckpointError(
                f"save_shards needs the group of all {dist.get_world_size()} ranks, got "
                f"{group.name!r} of {group.size}; pass topology.group('world')"
            )
        self.rank, self.size = group.rank, group.size

    def gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.group.pg)
        except Exception as exc:  # a collective timeout, or a peer that left
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(
                f"checkpoint save: rank {self.rank} could not exchange its status with the "
                f"other {self.size - 1} rank(s) ({type(exc).__name__}: {first}). Every rank "
                "must call save_checkpoint (or save_shards) at the same step: each writes its "
                "own shard, rank 0 only adds the manifest and `latest`. A save under "
                "`if rank == 0:` waits here for ranks that never come; call it on all ranks"
            ) from exc
        return out


def _failures(statuses: list[str | None], what: str) -> None:
    bad = [(r, s) for r, s in enumerate(statuses) if s]
    if bad:
        raise CheckpointError(
            f"checkpoint save failed while {what}:\n"
            + "\n".join(f"  rank {r}: {s}" for r, s in bad)
        )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


def _check_local(
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    pieces: Sequence[Piece],
    rank_state: dict[str, Any],
) -> None:
    where = f"save_shards (rank {rank})"
    for key, t in tensors.items():
        if not isinstance(key, str) or not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{where}: tensors[{key!r}] must be a tensor under a str key")
        if t.dtype not in BY_MANIFEST_NAME.values():
            raise CheckpointError(
                f"{where}: tensors[{key!r}] has dtype {t.dtype}; supported: {sorted(BY_MANIFEST_NAME)}"
            )
    for i, p in enumerate(pieces):
        if not isinstance(p, Piece):
            raise CheckpointError(f"{where}: pieces[{i}] is a {type(p).__name__}, not a Piece")
        p.check(f"{where}: pieces[{i}]")
        t = tensors.get(p.key)
        if t is None:
            raise CheckpointError(
                f"{where}: pieces[{i}] ({p.name!r}, {p.state!r}) refers to key {p.key!r}, "
                f"which is not in this rank's tensors"
            )
        if t.dim() != 1 or p.offset + p.numel > t.numel():
            raise CheckpointError(
                f"{where}: pieces[{i}] ({p.name!r}, {p.state!r}) needs elements "
                f"[{p.offset}, {p.offset + p.numel}) of a 1-D tensor {p.key!r}, but it has "
                f"shape {tuple(t.shape)}"
            )
    check_json(rank_state, f"rank_state (rank {rank})")


def _prepare(save_dir: Path, tag: str, meta: Any, keep_last: int | None) -> Path:
    """Rank 0: validate the meta, make ``.tmp-<tag>`` fresh, settle an interrupted save."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} must be None (keep all) or >= 1")
    check_meta(meta, "save_shards meta (rank 0)")
    check_json(meta, "meta", str_keys=False)
    save_dir.mkdir(parents=True, exist_ok=True)
    storage.restore_old(save_dir)
    final = save_dir / tag
    if final.exists() and not storage.is_complete(final):
        raise CheckpointError(
            f"{final} exists and is not a meshtrain checkpoint (no {MANIFEST}); move it away "
            f"or save under another tag"
        )
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _write_shard(
    tmp: Path, tag: str, rank: int, tensors: Mapping[str, torch.Tensor]
) -> tuple[Path, dict[str, Any]]:
    """Write this rank's file; return it and its checksum record (hashed from the host
    tensors handed to safetensors, so the written file is never read again)."""
    from safetensors.torch import save_file

    path = tmp / rank_file(rank)
    # safetensors writes host memory; detached contiguous CPU tensors (no-ops when already so)
    host = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    try:
        save_file(host, path, metadata={"format": "pt", "tag": tag, "rank": str(rank)})
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(
            f"save_shards (rank {rank}): safetensors could not write {path}: {exc}; tensors "
            f"under different keys must not overlap in memory"
        ) from exc
    # the tensors are hashed while fsync waits for the disk (it releases the GIL): this
    # core is idle then, so the checksums add CPU time but little wall time to a save even
    # with no second core free. (Hashing on a thread from before save_file was tried: it
    # competes with safetensors' copy into the page cache whenever no core is free.)
    with ThreadPoolExecutor(1, thread_name_prefix="meshtrain-fsync") as pool:
        synced = pool.submit(storage.fsync_file, path)
        record = tensor_files.record_from_tensors(path, *tensor_files.tensor_digests(host))
        synced.result()
    return path, record


def _commit(
    save_dir: Path,
    tag: str,
    tmp: Path,
    meta: dict[str, Any],
    infos: list[dict[str, Any]],
    keep_last: int | None,
    phase: Callable[[str], None],
) -> None:
    manifest = build_manifest(tag, meta, infos, time.time())
    # an engine bug (pieces that do not tile a tensor) is caught here, before anything moves
    parse_manifest(manifest, f"checkpoint {tag!r} being saved to {save_dir}")
    with open(tmp / MANIFEST, "w") as f:
        f.write(checksums.seal(dumps(manifest)))  # the manifest carries its own checksum
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    phase("manifest_written")
    final, old = save_dir / tag, None
    if final.exists():
        old = save_dir / f"{OLD_PREFIX}{tag}"
        os.rename(final, old)
        fsync_dir(save_dir)
        phase("moved_aside")
    os.rename(tmp, final)
    fsync_dir(save_dir)
    phase("renamed")
    if old is not None:
        shutil.rmtree(old)
    write_atomic(save_dir / LATEST, tag)
    phase("latest_written")
    if keep_last is not None:
        storage.apply_retention(save_dir, keep_last)


def save_shards(
    save_dir: str | os.PathLike,
    tag: str,
    *,
    group: Group | None,
    tensors: Mapping[str, torch.Tensor],
    pieces: Sequence[Piece],
    rank_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    keep_last: int | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> Path:
    """Save this rank's shard as part of checkpoint ``save_dir/tag``; every rank calls it.

    ``group``: the world group (``topology.group("world")``); its rank numbers the files.
    ``None`` for a single process without torch.distributed.
    ``tensors``: this rank's tensors by key (pieces point into 1-D ones; other tensors,
    e.g. RNG states, are stored as they are and read back with ``rank_tensor``).
    ``pieces``: where this rank's elements of each (name, state) live (``Piece``).
    ``rank_state``: JSON-able per-rank state (RNG, scheduler, sampler).
    ``meta``: JSON-able checkpoint meta with a ``tensors`` table; rank 0's copy is used.
    ``keep_last``: keep this many newest complete tags (never the one ``latest`` names).
    ``on_phase``: called with each name in ``PHASES`` as it is reached (tests kill there).

    Returns ``save_dir/tag`` once the checkpoint is complete and ``latest`` names it. Raises
    ``CheckpointError`` on every rank if any rank failed; ``latest`` is then unchanged.
    """
    chan = _Channel(group)
    save_dir = Path(save_dir)
    phase = on_phase or (lambda _name: None)
    rank_state = {} if rank_state is None else rank_state
    made: list[Path] = []  # the .tmp-<tag> this call created (rank 0)
    try:
        return _save(chan, save_dir, tag, tensors, pieces, rank_state, meta, keep_last, phase, made)
    except CheckpointError:
        # a failed exchange (a rank that never called save) must not leave .tmp-<tag>
        for tmp in made:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(chan, save_dir, tag, tensors, pieces, rank_state, meta, keep_last, phase, made):
    rank = chan.rank
    tmp = save_dir / f"{TMP_PREFIX}{tag}"
    err, created = None, False
    try:
        check_tag(tag)
        _check_local(rank, tensors, pieces, rank_state)
        if rank == 0:  # one line naming the folder and the fix, not a traceback mid-save
            need = chan.size * sum(t.numel() * t.element_size() for t in tensors.values())
            check_writable(save_dir, CheckpointError, what="checkpoint folder", need_bytes=need)
            tmp, created = _prepare(save_dir, tag, meta, keep_last), True
            made.append(tmp)
    except Exception as exc:  # noqa: BLE001 - gathered: every rank leaves together
        err = _describe(exc)
    statuses = chan.gather(err)
    if created and any(statuses):
        shutil.rmtree(tmp, ignore_errors=True)
    _failures(statuses, f"preparing {save_dir / tag}")

    info, err = None, None
    try:
        path, record = _write_shard(tmp, tag, rank, tensors)
        info = {
            "rank": rank,
            "file": path.name,
            "size": record["size"],
            "checksum": record,
            "state": rank_state,
            "tensor_dtypes": {k: dtype_name(t.dtype) for k, t in tensors.items()},
            "pieces": [p.to_json() for p in pieces if p.numel],
        }
    except Exception as exc:  # noqa: BLE001 - gathered: every rank leaves together
        err = _describe(exc)
    if err is None:
        phase("shard_written")
    gathered = chan.gather((info, err))
    if rank == 0 and any(e for _, e in gathered):
        shutil.rmtree(tmp, ignore_errors=True)
    _failures([e for _, e in gathered], f"writing shards into {tmp}")

    err = None
    if rank == 0:
        try:
            _commit(save_dir, tag, tmp, meta, [i for i, _ in gathered], keep_last, phase)
        except Exception as exc:  # noqa: BLE001 - gathered: every rank leaves together
            err = _describe(exc)
            shutil.rmtree(tmp, ignore_errors=True)  # gone already if the rename happened
    _failures(chan.gather(err)[:1], f"committing {save_dir / tag}")
    return save_dir / tag
