"""The checkpoint format: pieces, the manifest, and the checks both writer and reader run.

A checkpoint is a directory ``save_dir/<tag>/`` holding one safetensors file per rank
(``rank00000.safetensors``, ...) and one ``manifest.json`` written by rank 0::

    {
      "format": "meshtrain-checkpoint", "format_version": 2, "meshtrain_version": "0.1.0",
      "tag": "global_step100", "world_size": 2, "created_unix": 1.7e9,
      "meta": {                       # from the engine, JSON-able, rank 0's copy
        "tensors": {name: {"shape": [...], "dtype": "bfloat16", "kind": "param"}, ...},
        "aliases": {alias: canonical}, # tied weights
        ...                            # step counters, config, mesh, zero stage, hf_config
      },
      "ranks": [
        {"rank": 0, "file": "rank00000.safetensors", "size": 1234,
         "checksum": {"algo": "xxh3_64", "size": 1234, "header": "...",
                      "tensors": {key: "..."}},   # older manifests: "sha256": "..."
         "state": {...},               # that rank's JSON state (RNG, scheduler, sampler)
         "pieces": [{"name": "w", "state": "param", "key": "flat.param",
                     "offset": 0, "start": 0, "numel": 6}, ...]},
        ...
      ],
      "_checksum": "xxh3_64:..."      # over every byte above (files.checksums.seal)
    }

A **piece** says that elements ``[start, start + numel)`` of the *flattened full*
tensor ``name`` (its optimizer state ``state``, or ``"param"`` for the value itself) are
stored at elements ``[offset, offset + numel)`` of the 1-D tensor ``key`` in that rank's
file. The pieces of one ``(name, state)`` from all ranks tile ``[0, numel)`` exactly; both
the writer (before it commits) and the reader (before it trusts a checkpoint) check that.

Why pieces over the flattened index: they say nothing about *how* the writer was laid out
(data-parallel size, ZeRO stage, a flat buffer or one tensor per parameter), so any reader
can assemble any element range without knowing the writer's layout; loading under another
world size or ZeRO stage is "read the ranges I now own". Tensor- and pipeline-parallel
writers fit the same description later (a pipeline stage writes the names it holds; a
row-split tensor shard is a run of the flattened index, a column split is several runs),
and new optional fields on a piece or a rank entry stay readable by this version, so
adding them needs no format break.

Versions: a reader reads every ``format_version`` up to its own and refuses a newer one by
name, with the version of meshtrain that wrote it and the fix (upgrade). 1: a whole-file
``sha256`` per rank file (a per-tensor ``checksum`` record in the last version-1 writers);
2 (issue 32): the per-tensor record in every rank entry and the manifest sealed with its
own checksum -- a reader of version 1 could not check either, so it must refuse these.

Size: one piece is ~100 bytes of JSON; a ZeRO-3 job with P parameters, S optimizer states
and R ranks writes at most about P x (S + 1) x R pieces (most parameters fall on one or two
ranks' ranges, so far fewer in practice).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import torch

from meshtrain.dtypes import BY_MANIFEST_NAME
from meshtrain.errors import CheckpointError
from meshtrain.version import __version__

FORMAT = "meshtrain-checkpoint"
FORMAT_VERSION = 2  # see "Versions" above; bump when a reader of the previous one would misread
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
KINDS = ("param", "buffer", "frozen")

_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")


def rank_file(rank: int) -> str:
    """File name of one rank's shard: ``rank00003.safetensors``."""
    return f"rank{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling the manifest uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "dtype") -> torch.dtype:
    """The torch dtype of a manifest dtype string; CheckpointError names ``where``."""
    try:
        return BY_MANIFEST_NAME[name]
    except KeyError:
        raise CheckpointError(
            f"{where}: unknown dtype {name!r}; use one of {sorted(BY_MANIFEST_NAME)}"
        ) from None


def check_tag(tag: str) -> str:
    """A tag must be one plain directory name: not empty, no slashes, no leading dot."""
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not usable as a directory name; use letters, digits "
            f"and _ . + = - only, not starting with '.' and not {LATEST!r} "
            f"(e.g. 'global_step100')"
        )
    return tag


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start+numel)`` of flattened ``name``/``state`` live at
    ``[offset, offset+numel)`` of 1-D tensor ``key`` in one rank's file (module docstring)."""

    name: str
    state: str
    key: str
    offset: int
    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any, where: str) -> Piece:
        try:
            p = cls(**{f: d[f] for f in ("name", "state", "key", "offset", "start", "numel")})
        except (KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{where}: malformed piece {d!r} ({exc}); a piece needs name, state, key, "
                f"offset, start and numel"
            ) from None
        p.check(where)
        return p

    def check(self, where: str) -> None:
        """Types and signs only; bounds are checked against shapes and files elsewhere."""
        for f in ("name", "state", "key"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise CheckpointError(f"{where}: piece {self} has an empty or non-string {f}")
        for f in ("offset", "start", "numel"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise CheckpointError(
                    f"{where}: piece {self} has {f}={v!r}; it must be an integer >= 0"
                )


def check_json(value: Any, path: str, *, str_keys: bool = True) -> None:
    """Raise CheckpointError naming the key path of the first value JSON cannot store.

    With ``str_keys`` dict keys must be strings: JSON would turn ``1`` into ``"1"``
    silently, which breaks an exact resume of per-rank state. The meta allows int keys
    (they come back as strings; transformers' ``config.to_dict()`` has them in
    ``id2label`` and converts them back itself). Tuples come back as lists.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) and (str_keys or not isinstance(k, int)):
                raise CheckpointError(
                    f"{path}: key {k!r} is a {type(k).__name__}; JSON state needs string keys "
                    f"(convert with str() and back on load)"
                )
            check_json(v, f"{path}.{k}", str_keys=str_keys)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json(v, f"{path}[{i}]", str_keys=str_keys)
        return
    hint = (
        "store tensors in the rank's safetensors tensors instead"
        if isinstance(value, torch.Tensor)
        else "convert it to int/float/str/list/dict (e.g. .item() or .tolist())"
    )
    raise CheckpointError(f"{path}: a {type(value).__name__} is not JSON-able; {hint}")


def check_meta(meta: Any, where: str) -> dict[str, dict[str, Any]]:
    """Validate ``meta["tensors"]`` and ``meta["aliases"]``; return the tensors table."""
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), dict):
        raise CheckpointError(
            f"{where}: meta must be a dict with a 'tensors' table "
            f"{{name: {{'shape': [...], 'dtype': 'float32', 'kind': 'param'}}}}"
        )
    tensors = meta["tensors"]
    for name, spec in tensors.items():
        w = f"{where}: meta.tensors[{name!r}]"
        if not isinstance(spec, dict):
            raise CheckpointError(f"{w} must be a dict with shape, dtype and kind")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise CheckpointError(f"{w}.shape={shape!r} must be a list of integers >= 0")
        dtype_from_name(spec.get("dtype"), f"{w}.dtype")
        if spec.get("kind") not in KINDS:
            raise CheckpointError(f"{w}.kind={spec.get('kind')!r} must be one of {KINDS}")
    aliases = meta.get("aliases", {})
    if not isinstance(aliases, dict):
        raise CheckpointError(f"{where}: meta.aliases must be a dict {{alias: canonical}}")
    for alias, canon in aliases.items():
        if canon not in tensors or alias in tensors:
            raise CheckpointError(
                f"{where}: meta.aliases[{alias!r}] = {canon!r}: the canonical name must be in "
                f"meta.tensors and the alias must not be"
            )
    return tensors


def full_numel(spec: dict[str, Any]) -> int:
    return math.prod(spec["shape"])


def check_coverage(
    tensors: dict[str, dict[str, Any]], pieces_by_rank: list[list[Piece]], where: str
) -> dict[tuple[str, str], list[tuple[Piece, int]]]:
    """Every (name, state) must be tiled exactly by its pieces; every non-empty tensor
    needs its ``"param"`` state. Returns ``{(name, state): [(piece, rank), ...]}`` by start.
    """
    index: dict[tuple[str, str], list[tuple[Piece, int]]] = defaultdict(list)
    for rank, pieces in enumerate(pieces_by_rank):
        for p in pieces:
            if p.name not in tensors:
                raise CheckpointError(
                    f"{where}: rank {rank} has a piece of {p.name!r}, which is not in "
                    f"meta.tensors; every piece must name a tensor listed in the meta"
                )
            if p.numel:
                index[(p.name, p.state)].append((p, rank))
    for name, spec in tensors.items():
        if full_numel(spec) and (name, "param") not in index:
            raise CheckpointError(
                f"{where}: tensor {name!r} has no 'param' pieces; its value is missing "
                f"from every rank's file"
            )
    for (name, state), entries in index.items():
        entries.sort(key=lambda e: e[0].start)
        total, pos = full_numel(tensors[name]), 0
        for p, rank in entries:
            if p.start > pos:
                raise CheckpointError(
                    f"{where}: pieces of {name!r} (state {state!r}) leave elements "
                    f"[{pos}, {p.start}) of {total} uncovered; the pieces of all ranks must "
                    f"tile [0, {total}) exactly"
                )
            if p.start < pos:
                raise CheckpointError(
                    f"{where}: pieces of {name!r} (state {state!r}) overlap at elements "
                    f"[{p.start}, {min(pos, p.end)}) (rank {rank}, key {p.key!r}); the "
                    f"pieces of all ranks must tile [0, {total}) exactly"
                )
            pos = p.end
        if pos != total:
            raise CheckpointError(
                f"{where}: pieces of {name!r} (state {state!r}) leave elements "
                f"[{pos}, {total}) of {total} uncovered (shape {tensors[name]['shape']}); the "
                f"pieces of all ranks must tile [0, {total}) exactly"
            )
    return dict(index)


def build_manifest(
    tag: str, meta: dict[str, Any], infos: list[dict[str, Any]], created_unix: float
) -> dict[str, Any]:
    """The manifest dict from rank 0's meta and each rank's gathered file info."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "meshtrain_version": __version__,
        "tag": tag,
        "world_size": len(infos),
        "created_unix": created_unix,
        "meta": meta,
        "ranks": infos,
    }


def check_version(version: Any, writer: Any, where: str) -> None:
    """Refuse a ``format_version`` this meshtrain cannot read, naming it and the fix."""
    if (
        isinstance(version, int)
        and not isinstance(version, bool)
        and 1 <= version <= FORMAT_VERSION
    ):
        return
    by = f" (written by meshtrain {writer})" if isinstance(writer, str) else ""
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format_version {version}{by} is newer than this meshtrain "
            f"{__version__} reads (format_version 1 to {FORMAT_VERSION}); upgrade meshtrain "
            f"(pip install -U meshtrain) to load it, or load it where it was written and "
            f"save it again from there"
        )
    raise CheckpointError(
        f"{where}: format_version {version!r}{by} is not a version of the meshtrain "
        f"checkpoint format (1 to {FORMAT_VERSION}); the manifest is damaged or was not "
        f"written by meshtrain: load another tag"
    )


def parse_manifest(
    data: dict[str, Any], where: str
) -> tuple[dict[str, Any], list[list[Piece]], dict[tuple[str, str], list[tuple[Piece, int]]]]:
    """Validate a manifest dict; return (meta, pieces by rank, coverage index)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f'{where}: not a meshtrain checkpoint manifest (no "format": "{FORMAT}")'
        )
    version = data.get("format_version")
    check_version(version, data.get("meshtrain_version"), where)
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks or len(ranks) != data.get("world_size"):
        raise CheckpointError(f"{where}: 'ranks' must list one entry per rank of world_size")
    pieces_by_rank: list[list[Piece]] = []
    for r, entry in enumerate(ranks):
        w = f"{where}: ranks[{r}]"
        if not isinstance(entry, dict) or entry.get("rank") != r:
            raise CheckpointError(f"{w} is malformed or out of order (expected rank {r})")
        for f, typ in (("file", str), ("size", int), ("state", dict)):
            if not isinstance(entry.get(f), typ):
                raise CheckpointError(f"{w}.{f} is missing or not a {typ.__name__}")
        # "checksum": per-tensor xxh3-64 record (tensor_files); "sha256": version 1 only
        rec = entry.get("checksum")
        if not (version < 2 and isinstance(entry.get("sha256"), str)) and not (
            isinstance(rec, dict)
            and isinstance(rec.get("header"), str)
            and isinstance(rec.get("tensors"), dict)
            and rec.get("size") == entry["size"]
        ):
            raise CheckpointError(f"{w}.checksum is missing or malformed")
        if "/" in entry["file"] or entry["file"].startswith("."):
            raise CheckpointError(f"{w}.file={entry['file']!r} must be a plain file name")
        pieces_by_rank.append(
            [Piece.from_json(p, f"{w}.pieces[{i}]") for i, p in enumerate(entry.get("pieces", []))]
        )
    meta = data.get("meta")
    tensors = check_meta(meta, where)
    return meta, pieces_by_rank, check_coverage(tensors, pieces_by_rank, where)


def dumps(manifest: dict[str, Any]) -> str:
    """Manifest JSON that a person can read and diff: a container goes on one line when
    that line stays short (a piece, a tensor spec, a shape), else one item per line."""
    return _pretty(manifest, 0) + "\n"


def _pretty(value: Any, depth: int, width: int = 100) -> str:
    flat = json.dumps(value, separators=(", ", ": "), allow_nan=True)
    if not isinstance(value, (dict, list)) or not value or len(flat) + depth <= width:
        return flat
    if isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value):
        return flat  # a long list of numbers (an RNG state) stays on one line
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_pretty(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    items = [f"{inner}{_pretty(v, depth + 1)}" for v in value]
    return "[\n" + ",\n".join(items) + f"\n{pad}]"
