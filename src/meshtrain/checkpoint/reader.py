"""Reading a checkpoint: any element range of any tensor, from whichever ranks hold it.

``CheckpointReader`` trusts nothing it has not checked: on opening it validates the
manifest (pieces tile every tensor exactly) and that every rank file exists with the size
the manifest records; the first time a rank file is actually read, its checksums are
verified (``integrity``: the header and every tensor, naming the damaged one) and its keys are checked against the pieces that point into it. A failure names the file
and what failed (missing, size, checksum, key) and what to do.

Reads are lazy and narrow: ``read(name, state, start, numel)`` touches only the pieces
overlapping ``[start, start+numel)`` and, inside each, only those elements
(``safetensors.safe_open(...).get_slice``), so a rank loading its ZeRO partition reads its
share of the bytes, not the checkpoint. Nothing is unpickled.

Memory: safetensors memory-maps the files it opens; pages it touched stay counted in RSS
while the file is open. ``release()`` closes the files (consolidation calls it after each
tensor, which keeps its peak near one tensor).
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
        self._handles: dict[int, Any] = {}
        self._checked: set[int] = set()
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

    def _open(self, rank: int) -> Any:
        handle = self._handles.get(rank)
        if handle is not None:
            return handle
        from safetensors import safe_open

        entry = self._rank_entry(rank)
        f = self.path / entry["file"]
        if rank not in self._checked:
            self._check_size(entry)
            if self._verify:
                integrity.verify_rank_file(f, entry)
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(
                f"checkpoint file {f} (rank {rank}) is not a readable safetensors file "
                f"({exc}); restore it or load another tag"
            ) from None
        if rank not in self._checked:
            keys = set(handle.keys())
            for p in self._pieces[rank]:
                shape = handle.get_slice(p.key).get_shape() if p.key in keys else None
                if shape is None or len(shape) != 1 or p.offset + p.numel > shape[0]:
                    raise CheckpointError(
                        f"checkpoint file {f} (rank {rank}): piece of {p.name!r} "
                        f"({p.state!r}) needs elements [{p.offset}, {p.offset + p.numel}) "
                        f"of key {p.key!r}, which has shape {shape}; the file does not match "
                        f"its manifest"
                    )
            self._checked.add(rank)
        self._handles[rank] = handle
        return handle

    def release(self) -> None:
        """Close the open files (unmaps them); later reads reopen them (no re-hash)."""
        self._handles.clear()

    def close(self) -> None:
        self.release()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def rank_keys(self, rank: int) -> list[str]:
        return sorted(self._open(rank).keys())

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor:
        """A whole tensor from one rank's file (e.g. its torch RNG state)."""
        f = self._open(rank)
        if key not in set(f.keys()):
            raise CheckpointError(
                f"{self.path / self._rank_entry(rank)['file']}: no tensor {key!r}; "
                f"keys there: {_short(sorted(f.keys()))}"
            )
        return f.get_tensor(key)

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
                chunk = self._open(rank).get_slice(p.key)[p.offset + lo : p.offset + hi]
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
