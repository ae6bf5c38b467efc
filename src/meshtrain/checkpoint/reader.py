"""Reading a checkpoint: any element range of any tensor, from whichever ranks hold it.

``CheckpointReader`` trusts nothing it has not checked: on opening it validates the
manifest (pieces tile every tensor exactly) and that every rank file exists with the size
the manifest records; the first time a rank file is read, its header is checked against
the manifest's record and its keys against the pieces that point into it, and each tensor
is verified the first time it is read (``rank_file``: a whole key hashed block by block
as the load reads it, one pass over the bytes; a key read in part hashed in place, in the
page cache, before it is sliced). A failure names the file, what failed (missing, size,
header, tensor checksum, key) and what to do.

Reads are lazy and narrow: ``read(name, state, start, numel)`` touches only the pieces
overlapping ``[start, start+numel)``. A request that is one whole key is read straight into
the tensor returned (no second copy); a part of a key is sliced from safetensors' memory
map (``get_slice``), so a rank loading its ZeRO partition reads its share of the bytes,
not the checkpoint. Nothing is unpickled.

Memory: safetensors memory-maps the files it opens; pages it touched stay counted in RSS
while the file is open (verifying a key read in part hashes all of it in place, through a
map whose pages are dropped once hashed, so only the slices read stay counted).
``release()`` closes the files (consolidation calls it after each chunk,
which keeps its peak near one tensor).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint import integrity, storage
from meshtrain.checkpoint.manifest import MANIFEST, dtype_from_name, full_numel, parse_manifest
from meshtrain.checkpoint.rank_file import RankFile
from meshtrain.errors import CheckpointError

_LIST_MAX = 20  # names shown per category in a model-mismatch message


def _short(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_MAX])
    return shown + (f", ... and {len(items) - _LIST_MAX} more" if len(items) > _LIST_MAX else "")


class CheckpointReader:
    """A validated view of one checkpoint (see the module docstring).

    ``path``: a tag directory (holding ``manifest.json``), or a save_dir; then ``tag``
    picks the checkpoint, and ``tag=None`` loads the one ``latest`` names.
    ``verify``: check the manifest's own checksum, and each rank file's per-tensor
    checksums on first use (reads every byte once; turn off only to inspect a damaged
    checkpoint). ``None``: on, unless the environment sets ``MESHTRAIN_VERIFY=0``.
    """

    def __init__(
        self, path: str | os.PathLike, tag: str | None = None, *, verify: bool | None = None
    ) -> None:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint path {path} is not a directory; pass a save_dir (with a "
                f"'latest' file) or the directory of one checkpoint tag"
            )
        if tag is None and storage.is_complete(path):
            self.path = path
        else:
            if tag is None:
                tag = storage.latest_tag(path)
                if tag is None:
                    tags = storage.list_tags(path)
                    raise CheckpointError(
                        f"no checkpoint to load at {path}: it has neither {MANIFEST} nor a "
                        f"'latest' file; "
                        + (f"pass tag= one of {tags}" if tags else "no complete tags in it")
                    )
                try:
                    self.path = storage.tag_dir(path, tag)
                except CheckpointError as exc:
                    tags = storage.list_tags(path)
                    fix = f"write one of {tags} into it" if tags else "delete it"
                    raise CheckpointError(
                        f"{path / 'latest'} names tag {tag!r}, but {exc}. The file points "
                        f"nowhere (a copy or cleanup removed that tag): {fix}, or pass tag="
                    ) from None
            else:
                self.path = storage.tag_dir(path, tag)
        mpath = self.path / MANIFEST
        self._verify = integrity.verify_default(verify)
        data = integrity.read_manifest(mpath, self._verify)
        self._manifest = data
        self._meta, self._pieces, self._index = parse_manifest(data, str(mpath))
        self._starts = {k: [p.start for p, _ in v] for k, v in self._index.items()}
        self._files: dict[int, RankFile] = {}
        for entry in data["ranks"]:
            self._check_size(entry)

    # ---- manifest -------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        """The engine's meta dict (step counters, config, mesh, ``tensors``, ...)."""
        return self._meta

    @property
    def tag(self) -> str:
        return self._manifest["tag"]

    @property
    def world_size(self) -> int:
        """Number of ranks (files) the checkpoint was written by."""
        return self._manifest["world_size"]

    @property
    def aliases(self) -> dict[str, str]:
        """``{alias: canonical}`` of tied weights."""
        return dict(self._meta.get("aliases", {}))

    def rank_state(self, rank: int) -> dict[str, Any]:
        """The JSON state rank ``rank`` saved (RNG, scheduler, sampler, ...)."""
        return self._rank_entry(rank)["state"]

    def names(self, state: str = "param") -> list[str]:
        """Tensor names in state-dict order; for an optimizer state, those that have it."""
        if state == "param":
            return list(self._meta["tensors"])
        return [n for n in self._meta["tensors"] if (n, state) in self._index]

    def states(self) -> list[str]:
        """Every state stored: ``"param"`` and optimizer state names."""
        return sorted({s for _, s in self._index})

    def _canonical(self, name: str) -> str:
        name = self._meta.get("aliases", {}).get(name, name)
        if name not in self._meta["tensors"]:
            raise CheckpointError(
                f"{self.path}: no tensor {name!r} in this checkpoint "
                f"({len(self._meta['tensors'])} tensors, e.g. {_short(self.names()[:5])})"
            )
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta["tensors"][self._canonical(name)]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """The model's dtype of ``name`` (the stored "param" may be fp32 master weights)."""
        name = self._canonical(name)
        return dtype_from_name(self._meta["tensors"][name]["dtype"])

    # ---- files ----------------------------------------------------------------------
    def _rank_entry(self, rank: int) -> dict[str, Any]:
        if not 0 <= rank < self.world_size:
            raise CheckpointError(
                f"{self.path}: rank {rank} out of range; written by {self.world_size} ranks"
            )
        return self._manifest["ranks"][rank]

    def _check_size(self, entry: dict[str, Any]) -> None:
        f = self.path / entry["file"]
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint file {f} (rank {entry['rank']}) is missing; restore it or load "
                f"another tag (complete tags: {storage.list_tags(self.path.parent)})"
            ) from None
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint file {f} (rank {entry['rank']}) has {size} bytes but the "
                f"manifest says {entry['size']}: it is truncated or was modified; load "
                f"another tag or restore the file"
            )

    def _open(self, rank: int) -> RankFile:
        rf = self._files.get(rank)
        if rf is not None:
            return rf
        entry = self._rank_entry(rank)
        self._check_size(entry)
        rf = RankFile(
            self.path / entry["file"],
            rank,
            record=entry.get("checksum") if isinstance(entry.get("checksum"), dict) else None,
            sha256=entry.get("sha256"),
            verify=self._verify,
            fix=integrity.fix_for(self.path),
        )
        for p in self._pieces[rank]:
            shape = rf.shape(p.key) if p.key in rf.keys else None
            if shape is None or len(shape) != 1 or p.offset + p.numel > shape[0]:
                raise CheckpointError(
                    f"checkpoint file {rf.path} (rank {rank}): piece of {p.name!r} "
                    f"({p.state!r}) needs elements [{p.offset}, {p.offset + p.numel}) "
                    f"of key {p.key!r}, which has shape {shape}; the file does not match "
                    f"its manifest"
                )
        self._files[rank] = rf
        return rf

    def _slice(self, rank: int, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of 1-D key ``key`` of rank ``rank``'s file, verified: a
        view of the file's memory map once the parts it lies in (or the whole key) are
        hashed there (``rank_file``)."""
        rf = self._open(rank)
        rf.verify_elements(key, lo, hi)  # the parts it lies in, or the whole key, in place
        return rf.mapped().get_slice(key)[lo:hi]

    def verify_all(self) -> None:
        """Verify every byte of every rank file now, not only what is read (each tensor
        not yet verified hashed whole, in place); a no-op with ``verify=False``."""
        if not self._verify:
            return
        for rank in range(self.world_size):
            rf = self._open(rank)
            for key in rf.keys:
                rf.verify_key(key)

    def release(self) -> None:
        """Close the files (unmaps them); later reads reopen them (what was verified is not
        hashed again)."""
        for rf in self._files.values():
            rf.close()

    def close(self) -> None:
        self.release()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def rank_keys(self, rank: int) -> list[str]:
        return sorted(self._open(rank).keys)

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor:
        """A whole tensor from one rank's file (e.g. its torch RNG state)."""
        rf = self._open(rank)
        if key not in rf.keys:
            raise CheckpointError(
                f"{self.path / self._rank_entry(rank)['file']}: no tensor {key!r}; "
                f"keys there: {_short(sorted(rf.keys))}"
            )
        return rf.read_key(key).reshape(rf.shape(key))

    # ---- tensors --------------------------------------------------------------------
    def iter_chunks(
        self,
        name: str,
        state: str = "param",
        start: int = 0,
        numel: int | None = None,
        *,
        max_numel: int | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(flat_start, 1-D tensor)`` covering ``[start, start+numel)`` in order,
        each at most ``max_numel`` elements (None: one chunk per piece)."""
        name = self._canonical(name)
        total = full_numel(self._meta["tensors"][name])
        numel = total - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(
                f"{self.path}: elements [{start}, {start + numel}) of {name!r} are out of "
                f"range; it has {total} elements"
            )
        if numel == 0:
            return
        entries = self._index.get((name, state))
        if entries is None:
            have = sorted(s for n, s in self._index if n == name)
            raise CheckpointError(
                f"{self.path}: no state {state!r} stored for {name!r} (it has {have}); "
                f"load without optimizer states or pick one of those"
            )
        i = bisect_right(self._starts[(name, state)], start) - 1
        pos, end, dtype = start, start + numel, None
        while pos < end:
            p, rank = entries[i]
            a, b = pos - p.start, min(end, p.end) - p.start
            step = b - a if max_numel is None else max(1, max_numel)
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                # a fresh slice per chunk: holding none across a yield lets release() unmap
                chunk = self._slice(rank, p.key, p.offset + lo, p.offset + hi)
                if dtype is None:
                    dtype = chunk.dtype
                elif chunk.dtype != dtype:
                    raise CheckpointError(
                        f"{self.path}: pieces of {name!r} ({state!r}) are stored in "
                        f"different dtypes ({dtype} and {chunk.dtype} in rank {rank}'s file)"
                    )
                yield p.start + lo, chunk
            pos, i = p.end, i + 1

    def read(
        self, name: str, state: str = "param", start: int = 0, numel: int | None = None
    ) -> torch.Tensor:
        """Elements ``[start, start+numel)`` of flattened ``name`` (its ``state``), 1-D,
        in the stored dtype (fp32 master weights for trainable params)."""
        whole = self._one_key(name, state, start, numel)
        if whole is not None:
            return whole
        out = None
        for pos, chunk in self.iter_chunks(name, state, start, numel):
            if out is None:
                total = full_numel(self._meta["tensors"][self._canonical(name)])
                n = total - start if numel is None else numel
                out = torch.empty(n, dtype=chunk.dtype)
            out[pos - start : pos - start + chunk.numel()] = chunk
        if out is None:  # an empty range or tensor
            out = torch.empty(0, dtype=self.dtype(name))
        return out

    def _one_key(self, name: str, state: str, start: int, numel: int | None) -> torch.Tensor | None:
        """The result itself when the range is exactly one whole key of one rank file (the
        common case: a tensor, or a rank's whole flat partition): read once, no copy."""
        canon = self._canonical(name)
        entries = self._index.get((canon, state))
        if not entries or start < 0:
            return None
        i = bisect_right(self._starts[(canon, state)], start) - 1
        if i < 0:
            return None
        p, rank = entries[i]
        n = p.end - start if numel is None and len(entries) == i + 1 else numel
        if n is None or n <= 0 or start + n > p.end:
            return None
        first = p.offset + (start - p.start)
        rf = self._open(rank)
        if first != 0 or n != rf.shape(p.key)[0]:
            return None
        return rf.read_key(p.key).reshape(-1)

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        """The whole tensor in its shape (stored dtype)."""
        return self.read(name, state).reshape(self.shape(name))

    def check_model(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise CheckpointError listing missing keys, unexpected keys and shape mismatches
        between this checkpoint (tensors and aliases) and a model's ``{name: shape}``."""
        have = {n: tuple(s["shape"]) for n, s in self._meta["tensors"].items()}
        for alias, canon in self._meta.get("aliases", {}).items():
            have[alias] = have[canon]
        want = {n: tuple(s) for n, s in expected.items()}
        missing = [n for n in want if n not in have]
        unexpected = [n for n in have if n not in want]
        mismatched = [
            f"{n}: checkpoint {have[n]} vs model {want[n]}"
            for n in want
            if n in have and have[n] != want[n]
        ]
        if not (missing or unexpected or mismatched):
            return
        lines = [f"checkpoint {self.path} does not match the model:"]
        for label, items in (
            ("missing in checkpoint", missing),
            ("unexpected in checkpoint (not in the model)", unexpected),
            ("shape mismatches", mismatched),
        ):
            if items:
                lines.append(f"  {label} ({len(items)}): {_short(items)}")
        lines.append(
            "Fix: load a checkpoint saved from this model's architecture and config, or "
            "build the model with the config stored in the checkpoint's meta."
        )
        raise CheckpointError("\n".join(lines))
