"""A ``save_pretrained`` folder (or one ``.safetensors`` file) read by element ranges, each
rank reading only the bytes of its own slices (``meshtrain.from_pretrained``'s source).

The files are read with ``pread`` from the format's own header, not through a memory map:
the pages a map touches stay resident while it is open, which would add the read part of
every tensor to the rank's memory (see ``sliced_load``'s docstring for the figures).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import CheckpointError
from meshtrain.files.structured import load_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class _SafetensorsFile:
    """One ``.safetensors`` file read with ``pread`` into fresh buffers, never mapped.

    Why not ``safe_open``: its tensors are views of a memory map of the whole file, and
    every page a copy touches counts in the process's RSS until the map is dropped,
    which happens only when the last view and handle are collected (measured at ZeRO-3
    over 4 ranks: +32 MiB of file-backed RSS per rank after the read loop). Here a read
    costs exactly its own bytes, read into the destination when it can take them
    (:meth:`SafetensorsSource.read_into`). The layout is the format's:
    an 8-byte little-endian header length, a JSON header (``dtype``, ``shape``,
    ``data_offsets`` from the end of the header), then the data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            (n,) = struct.unpack("<Q", self._pread(8, 0))
            header = json.loads(self._pread(n, 8))
        except (struct.error, ValueError) as e:
            os.close(self.fd)
            raise CheckpointError(
                f"{path}: not a safetensors file (its header does not parse: {e}); "
                "re-export it with save_pretrained or safetensors.torch.save_file"
            ) from None
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries: dict[str, dict] = header
        # a file cut short (an interrupted copy) is named before any of it is loaded
        need = self.base + max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        size = os.fstat(self.fd).st_size
        if size < need:
            os.close(self.fd)
            raise CheckpointError(
                f"{path}: truncated ({size} of the {need} bytes its header describes); copy "
                "the file again from where it was written"
            )

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise CheckpointError(f"{self.path}: truncated ({len(data)} of {n} bytes at {offset})")
        return data

    def use_aliases(self, aliases: Mapping[str, str]) -> None:
        """The engine's tied names (alias -> canonical), for a key saved under either."""
        self.aliases = dict(aliases)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self.entries[name]["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {code!r}, which meshtrain cannot "
                f"read (known: {', '.join(_DTYPES)}); convert the checkpoint to one of those"
            )
        return _DTYPES[code]

    def read(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor ``name``."""
        dtype = self.dtype(name)
        out = torch.empty(numel, dtype=dtype)
        self.read_into(name, start, out)
        return out

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of ``name`` into ``out`` (a
        contiguous CPU tensor of the file's dtype), with no buffer in between."""
        size = self.dtype(name).itemsize
        buf = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
        offset = self.base + self.entries[name]["data_offsets"][0] + start * size
        done = 0
        while done < len(buf):
            got = os.preadv(self.fd, [buf[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(
                    f"{self.path}: truncated reading {name!r} ({done} of {len(buf)} bytes)"
                )
            done += got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SafetensorsSource:
    """A ``save_pretrained`` folder or one ``.safetensors`` file, read by element ranges
    of each tensor's flattened index (the engine loader's interface)."""

    def __init__(self, path: str | os.PathLike, fallback: Mapping[str, torch.Tensor] | None = None):
        self.path = Path(path)
        p = self.path
        if p.is_dir() and (p / INDEX).is_file():
            fix = "save the model again with save_pretrained"
            index = load_json(p / INDEX, CheckpointError, what="weight index", fix=fix)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{p / INDEX}: no 'weight_map' object; {fix}")
            self._file_of = {k: p / f for k, f in weight_map.items()}
        elif p.is_dir() and (p / SINGLE).is_file():
            self._file_of = None
            self._single = p / SINGLE
        elif p.is_file() and p.suffix == ".safetensors":
            self._file_of = None
            self._single = p
        else:
            raise CheckpointError(
                f"{p}: no {INDEX} or {SINGLE} (a save_pretrained folder), and not a "
                ".safetensors file or a meshtrain checkpoint; pass one of those"
            )
        self._handles: dict[Path, _SafetensorsFile] = {}
        if self._file_of is None:
            self._file_of = dict.fromkeys(self._open(self._single).keys(), self._single)
        self.fallback = dict(fallback or {})  # missing keys: the model's initialised values
        # transformers' load-time conversions (``convert``): a renamed key's name in its
        # file, and fused tensors built from per-expert ones
        self._in_file: dict[str, str] = {}
        self._fused: dict[str, list[list[str]]] = {}
        self._fused_from: dict[str, Path] = {}  # a fused tensor's source key: its file
        self.aliases: dict[str, str] = {}
        self.meta: dict[str, Any] = {}
        self.world_size = 0  # never the engine's: no RNG states to restore

    # the checkpoint reader's interface, as engine_io._load uses it -----------------------
    def _open(self, file: Path) -> _SafetensorsFile:
        if file not in self._handles:
            self._handles[file] = _SafetensorsFile(file)
        return self._handles[file]

    def convert(self, model_type: str | None) -> None:
        """Apply transformers' load-time conversion of ``model_type``'s checkpoints
        (``transformers.conversion_mapping``), as its ``from_pretrained`` does: renamed keys
        (Mixtral's ``.block_sparse_moe.`` is the model's ``.mlp.``), and experts stored one
        tensor per expert that the model holds as one 3-D tensor: ``MergeModulelist(0)``
        stacks the experts, ``Concatenate(1)`` then joins the stacks of several patterns
        (w1 and w3 into ``gate_up_proj``). A slice of a fused tensor is read from its
        sources' matching runs (``_fused_into``): the fused tensor is never built, so a
        rank holds only its slice. A conversion with other
        operations is left alone (``sliced_load`` then refuses the checkpoint by name)."""
        import re

        from transformers.conversion_mapping import (
            WeightConverter,
            WeightRenaming,
            get_checkpoint_conversion_mapping,
        )

        rules = (get_checkpoint_conversion_mapping(model_type) if model_type else None) or []
        for rule in rules:
            if isinstance(rule, WeightRenaming):
                pairs = list(zip(rule.source_patterns, rule.target_patterns, strict=True))
                for key in list(self._file_of):
                    new = key
                    for a, b in pairs:
                        new = new.replace(a, b)
                    if new != key:
                        self._file_of[new] = self._file_of.pop(key)
                        self._in_file[new] = self._in_file.pop(key, key)
        for rule in rules:
            if not isinstance(rule, WeightConverter) or len(rule.target_patterns) != 1:
                continue
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in rule.operations]
            if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                continue
            found: dict[str, list[list[tuple[int, str]]]] = {}
            for j, pattern in enumerate(rule.source_patterns):
                rx = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
                for key in self._file_of:
                    m = rx.search(key)
                    if m is None or m.end() != len(key):
                        continue
                    target = key[: m.start()] + rule.target_patterns[0]
                    parts = found.setdefault(target, [[] for _ in rule.source_patterns])
                    parts[j].append((int(m.group(1)), key))
            for target, parts in found.items():
                if not all(parts) or len({len(p) for p in parts}) != 1:
                    continue  # an incomplete set: leave the keys as they are (reported)
                self._fused[target] = [[k for _, k in sorted(p)] for p in parts]
                for p in parts:
                    for _, k in p:
                        self._fused_from[k] = self._file_of.pop(k)

    def _file_key(self, name: str) -> tuple[Path, str]:
        if name in self._file_of:
            return self._file_of[name], self._in_file.get(name, name)
        return self._fused_from[name], self._in_file.get(name, name)

    def _fused_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of the fused tensor ``name`` straight
        from its per-expert sources, no fused tensor built: element ``e R C + r C + c`` of
        the fused ``(E, R, C...)`` tensor (``R`` the rows of every pattern in order) is
        element ``(r - R_before) C + c`` of pattern ``j``'s tensor of expert ``e``, so each
        (expert, pattern) source covers one contiguous run of the fused elements, and the
        runs that meet the range are read into ``out`` in place."""
        flat = out.reshape(-1)
        end = start + flat.numel()
        groups = self._fused[name]
        shapes = []
        for keys in groups:
            file, key = self._file_key(keys[0])
            shapes.append(self._open(file).shape(key))
        per_expert = sum(_numel(sh) for sh in shapes)
        for e in range(len(groups[0])):
            base = e * per_expert
            for keys, sh in zip(groups, shapes, strict=True):
                n = _numel(sh)
                lo, hi = max(start, base), min(end, base + n)
                if lo < hi:
                    file, key = self._file_key(keys[e])
                    f = self._open(file)
                    piece = flat[lo - start : hi - start]
                    if f.dtype(key) == flat.dtype:
                        f.read_into(key, lo - base, piece)
                    else:
                        piece.copy_(f.read(key, lo - base, hi - lo))
                base += n

    def _fused_dtype(self, name: str) -> torch.dtype:
        file, key = self._file_key(self._fused[name][0][0])
        return self._open(file).dtype(key)

    def keys(self) -> list[str]:
        return [*self._file_of, *self._fused]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._fused:
            shapes = []
            for keys in self._fused[name]:
                file, key = self._file_key(keys[0])
                shapes.append(self._open(file).shape(key))
            first = shapes[0]
            return (len(self._fused[name][0]), sum(s[0] for s in shapes), *first[1:])
        file, key = self._file_key(name)
        return self._open(file).shape(key)

    def states(self) -> list[str]:
        return ["param"]

    def rank_state(self, rank: int) -> dict[str, Any]:
        return {}

    def check_model(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Only shape mismatches are errors here (missing and unexpected keys were
        reported, and the missing ones initialised, before the layout was applied)."""
        bad = [
            f"{n}: checkpoint {self.shape(n)} vs model {tuple(s)}"
            for n, s in expected.items()
            if (n in self._file_of or n in self._fused) and self.shape(n) != tuple(s)
        ]
        if bad:
            raise CheckpointError(
                f"{self.path} does not match the model: shape mismatches ({len(bad)}): "
                + "; ".join(bad[:5])
                + ". Fix: build the model from this checkpoint's config.json"
            )

    def _name(self, name: str) -> str | None:
        if name in self._file_of or name in self._fused:
            return name
        for alias, canon in self.aliases.items():  # a tied weight saved under another name
            if canon == name and alias in self._file_of:
                return alias
        return None

    def read(self, name: str, state: str = "param", start: int = 0, numel: int | None = None):
        """Elements ``[start, start + numel)`` of the flattened tensor: exactly those
        bytes, read into a fresh buffer (nothing else of the file enters the process)."""
        key = self._name(name)
        if key is None:
            full = self.fallback[name].reshape(-1)
            numel = full.numel() - start if numel is None else numel
            return full[start : start + numel].clone()
        if key in self._fused:
            numel = _numel(self.shape(key)) - start if numel is None else numel
            out = torch.empty(numel, dtype=self._fused_dtype(key))
            self._fused_into(key, start, out)
            return out
        file, in_file = self._file_key(key)
        f = self._open(file)
        numel = _numel(f.shape(in_file)) - start if numel is None else numel
        return f.read(in_file, start, numel)

    def read_into(self, name: str, start: int, out: torch.Tensor) -> bool:
        """Read ``out.numel()`` elements from ``start`` straight into ``out`` when it can
        take the file's bytes as they are (a contiguous CPU tensor of the file's dtype);
        False, reading nothing, otherwise (the loader then reads and converts): no
        buffer and no second copy per read."""
        key = self._name(name)
        if key is None or out.device.type != "cpu" or not out.is_contiguous():
            return False
        if key in self._fused:
            if self._fused_dtype(key) != out.dtype:
                return False
            self._fused_into(key, start, out)
            return True
        file, in_file = self._file_key(key)
        f = self._open(file)
        if not out.is_contiguous() or f.dtype(in_file) != out.dtype:
            return False
        f.read_into(in_file, start, out)
        return True

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        key = self._name(name)
        if key is None:
            return self.fallback[name].clone()
        return self.read(name).reshape(self.shape(key))

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["INDEX", "SINGLE", "SafetensorsSource"]
