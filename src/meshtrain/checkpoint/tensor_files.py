"""Checksums of safetensors files: recorded while writing, verified in one pass on load.

A safetensors file is ``8-byte header length N | N bytes of JSON header | tensor bytes``,
the tensors back to back with no gaps (the format requires it). So a record of

    {"algo": "xxh3_64", "size": bytes, "header": digest of the first 8 + N bytes,
     "tensors": {key: digest of that tensor's bytes},
     "parts": {"bytes": P, "tensors": {key: [digest of each P bytes of the tensor]}}}

covers every byte of the file, and a mismatch can say *which* tensor (and which byte range
of the file) is damaged rather than only "the file differs". ``parts`` (rank files of a
sharded checkpoint, keys over ``PART_BYTES``) lets a reader that wants part of a key
check only the parts it reads (``rank_file``); files and readers without it use the
whole-key digests.

Writing: ``tensor_digests`` hashes each tensor's bytes from memory as it is handed to
safetensors (the bytes safetensors writes are exactly the tensor's little-endian
contiguous bytes; the checkpoint writer runs it while fsync waits for the disk), and
``record_from_tensors`` reads back only the header; the streamed consolidated export
hashes each chunk as it writes it. Neither reads a written file again.

Reading: ``verify`` hashes each tensor once, in place in the page cache
(``checksums.digest_in_place``), front to back.

Files meshtrain did not write (a transformers ``save_pretrained`` folder) have no record;
``check_foreign`` validates what the format allows: a parseable header, offsets that tile
the data exactly and match the file size, byte lengths that match shape x dtype, and
floating dtypes against the ``torch_dtype``/``dtype`` its ``config.json`` declares.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.files import checksums
from meshtrain.files.atomic import write_atomic

_ST_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
MAX_HEADER = 100 << 20  # safetensors' own limit on the header size


PART_BYTES = checksums.CHUNK  # 4 MiB: what a partial read hashes at least, per key


def _digests(t: torch.Tensor) -> tuple[str, list[str] | None]:
    """The digest of a CPU tensor's bytes as safetensors stores them (contiguous, native
    LE) and, for one over ``PART_BYTES``, the digest of each part: each part is hashed
    on its own and then fed to the whole tensor's hash while it is still in cache, so the
    tensor is read from memory once."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    if b.nbytes <= PART_BYTES:
        return checksums.digest(b), None
    whole, parts = checksums.hasher(), []
    for lo in range(0, b.nbytes, PART_BYTES):
        part = b[lo : lo + PART_BYTES]
        parts.append(checksums.digest(part))
        whole.update(part)
    return whole.hexdigest(), parts


FOREIGN_FIX = "save the model again with save_pretrained"


def damaged(where: str, detail: str, fix: str) -> str:
    """The one-line message for a safetensors file that cannot be what it claims."""
    return f"{where} is damaged (truncated or not a safetensors file: {detail}); {fix}"


def header_bytes(f: Any, where: str, error: type[Exception], fix: str = FOREIGN_FIX) -> bytes:
    """The first 8 + N bytes of an open safetensors file; ``error`` if they cannot be."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise error(damaged(where, f"{len(head)} bytes, too short for a header", fix))
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER:
        raise error(damaged(where, f"the header length field says {n} bytes", fix))
    body = f.read(n)
    if len(body) < n:
        raise error(damaged(where, "the file ends inside its header", fix))
    return head + body


def parse_header(
    raw: bytes, where: str, error: type[Exception], fix: str = FOREIGN_FIX
) -> dict[str, Any]:
    """The header JSON as a dict (``__metadata__`` removed)."""
    try:
        header = json.loads(raw[8:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise error(damaged(where, f"the header is not valid JSON, {exc}", fix)) from None
    if not isinstance(header, dict):
        raise error(damaged(where, "the header is not a JSON object", fix))
    header.pop("__metadata__", None)
    return header


def tensor_digests(
    host: Mapping[str, torch.Tensor],
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``({key: digest}, {key: [part digests]})`` of the CPU tensors handed to
    ``safetensors.save_file`` (parts only for tensors over ``PART_BYTES``)."""
    whole, parts = {}, {}
    for k, t in host.items():
        whole[k], p = _digests(t)
        if p is not None:
            parts[k] = p
    return whole, parts


def record_from_tensors(
    path: str | os.PathLike,
    digests: Mapping[str, str],
    parts: Mapping[str, list[str]] | None = None,
) -> dict:
    """The checksum record of a file safetensors just wrote from tensors whose digests
    (``tensor_digests``) are ``digests`` and ``parts``: only its header is read back."""
    with open(path, "rb") as f:
        head = header_bytes(f, str(path), OSError)
        size = os.fstat(f.fileno()).st_size
    record = {
        "algo": checksums.ALGO,
        "size": size,
        "header": checksums.digest(head),
        "tensors": dict(digests),
    }
    if parts:
        record["parts"] = {"bytes": PART_BYTES, "tensors": dict(parts)}
    return record


def _ranges(
    header: dict[str, Any], where: str, error: type[Exception], fix: str = FOREIGN_FIX
) -> list[tuple]:
    spans = []
    for key, spec in header.items():
        try:
            begin, end = spec["data_offsets"]
            dtype, shape = spec["dtype"], spec["shape"]
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise error(damaged(where, f"header entry {key!r} is malformed", fix)) from None
        spans.append((begin, end, key, dtype, shape))
    return sorted(spans, key=lambda s: (s[0], s[1]))


def verify(
    path: str | os.PathLike, record: Mapping[str, Any], error: type[Exception], fix: str
) -> None:
    """Raise ``error`` naming the file, the damaged part (header or tensor with its byte
    range) and ``fix`` unless ``path`` matches ``record``."""
    where = os.fspath(path)
    if record.get("algo") != checksums.ALGO:
        raise error(f"{where}: checksum algorithm {record.get('algo')!r} is unknown; {fix}")
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the with below, after the missing-file case
    except FileNotFoundError:
        raise error(f"{where}: the file is missing; {fix}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != record["size"]:
            raise error(
                f"{where}: {size} bytes, but {record['size']} were written: the file is "
                f"truncated or was modified; {fix}"
            )
        head = header_bytes(f, where, error, fix)
        if checksums.digest(head) != record["header"]:
            raise error(
                f"{where}: the safetensors header (bytes 0..{len(head)}, which say where each "
                f"tensor lies) is corrupted: its {checksums.ALGO} checksum differs from the "
                f"one recorded at save; {fix}"
            )
        header = parse_header(head, where, error, fix)
        expected = record["tensors"]
        base = len(head)
        for begin, end, key, _dtype, _shape in _ranges(header, where, error, fix):
            want = expected.get(key)
            if want is None:
                raise error(f"{where}: tensor {key!r} has no recorded checksum; {fix}")
            if checksums.digest_in_place(f, base + begin, base + end) != want:
                raise error(
                    f"{where}: tensor {key!r} (bytes {base + begin}..{base + end} of the "
                    f"file) is corrupted: its {checksums.ALGO} checksum differs from the one "
                    f"recorded at save; {fix}"
                )
        if set(expected) != set(header):
            raise error(f"{where}: holds other tensors than were written; {fix}")


# ---- files meshtrain did not write ------------------------------------------------------
def config_dtype(config: Mapping[str, Any] | None) -> str | None:
    """The floating dtype a transformers ``config.json`` declares, if any."""
    if not config:
        return None
    value = config.get("torch_dtype", config.get("dtype"))
    return value if isinstance(value, str) and value in _FLOATS.values() else None


def layout(
    head: bytes, size: int, where: str, error: type[Exception], fix: str = FOREIGN_FIX
) -> dict[str, tuple[str, list[int], int, int]]:
    """``{key: (dtype code, shape, first byte, end byte)}`` of a safetensors file whose
    header is ``head`` and size ``size``, positions from the start of the file.

    Checked: the header parses; every tensor's dtype is known and its byte length is
    ``prod(shape) x itemsize``; the offsets tile the data area exactly and end at the end of
    the file. Anything else raises ``error`` naming ``where``, the tensor and ``fix``."""
    header = parse_header(head, where, error, fix)
    out: dict[str, tuple[str, list[int], int, int]] = {}
    pos, base = 0, len(head)
    for begin, end, key, dtype, shape in _ranges(header, where, error, fix):
        item = _ST_ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
        if item is None:
            raise error(damaged(where, f"tensor {key!r} has unknown dtype {dtype!r}", fix))
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise error(damaged(where, f"tensor {key!r} has a malformed shape {shape!r}", fix))
        if end - begin != math.prod(shape) * item:
            raise error(
                damaged(
                    where,
                    f"tensor {key!r} ({dtype}, shape {shape}) needs {math.prod(shape) * item} "
                    f"bytes, its offsets give {end - begin}",
                    fix,
                )
            )
        if begin != pos:
            raise error(
                damaged(where, f"tensor {key!r} starts at data byte {begin}, expected {pos}", fix)
            )
        pos = end
        out[key] = (dtype, shape, base + begin, base + end)
    if base + pos != size:
        what = "cut short" if base + pos > size else "longer than its header says"
        raise error(damaged(where, f"{size} bytes, its header describes {base + pos}: {what}", fix))
    return out


def check_foreign(
    path: str | os.PathLike, error: type[Exception], declared_dtype: str | None = None
) -> dict[str, Any]:
    """Validate a safetensors file without a checksum record; return its header.

    Checked: what ``layout`` checks, and floating tensors in ``declared_dtype`` (or
    float32, which some models keep for norms)."""
    where = os.fspath(path)
    fix = FOREIGN_FIX
    with open(path, "rb") as f:
        head = header_bytes(f, where, error)
        size = os.fstat(f.fileno()).st_size
    keys = layout(head, size, where, error)
    for key, (dtype, _shape, _begin, _end) in keys.items():
        if (
            declared_dtype
            and dtype in _FLOATS
            and _FLOATS[dtype] not in (declared_dtype, "float32")
        ):
            raise error(
                f"{where}: tensor {key!r} is {_FLOATS[dtype]}, but config.json declares "
                f"dtype {declared_dtype}; the weights and the config come from different "
                f"exports: {fix}"
            )
    return parse_header(head, where, error)


# ---- checksum sidecar of an export ------------------------------------------------------
SIDECAR = "meshtrain_checksums.json"
SIDECAR_FORMAT = "meshtrain-checksums"


def sidecar_of(path: Path) -> Path:
    """Where the checksums of an export live: ``<folder>/meshtrain_checksums.json``, or
    ``<file>.checksums.json`` beside a single-file export."""
    return path / SIDECAR if path.is_dir() else path.with_name(path.name + ".checksums.json")


def write_sidecar(path: Path, files: dict[str, dict[str, Any]]) -> Path:
    """Record ``{file name: record}`` for the export at ``path`` (sealed, atomic)."""
    out = sidecar_of(path)
    text = json.dumps({"format": SIDECAR_FORMAT, "version": 1, "files": files}, indent=1)
    write_atomic(out, checksums.seal(text))
    return out


def plain_record(path: Path) -> dict[str, Any]:
    """Record of a small non-tensor file (config.json): its size and whole-file digest."""
    return {
        "algo": checksums.ALGO,
        "size": path.stat().st_size,
        "digest": checksums.digest_file(path),
    }


def verify_export(path: str | os.PathLike, error: type[Exception]) -> bool:
    """Verify an export against its sidecar; False when it has none (not written by
    meshtrain, or by an older one). Raises ``error`` naming the damaged file and part."""
    from meshtrain.files.structured import parse_json
    from meshtrain.files.text import decode, read_bytes

    path = Path(path)
    side = sidecar_of(path)
    if not side.is_file():
        return False
    fix = (
        "export it again from the checkpoint (meshtrain consolidate); to load it anyway and "
        f"inspect it, set {checksums.VERIFY_ENV}=0"
    )
    raw = read_bytes(side, error, "checksum file")
    checksums.unseal(raw, str(side), error, fix)
    data = parse_json(decode(raw, str(side), error), str(side), error, fix=fix)
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise error(f"{side}: not a meshtrain checksum file; {fix}")
    folder = path if path.is_dir() else path.parent
    for name, rec in data.get("files", {}).items():
        f = folder / name
        if "tensors" in rec:
            verify(f, rec, error, fix)
            continue
        if not f.is_file():
            raise error(f"{f}: the file is missing; {fix}")
        if f.stat().st_size != rec["size"] or checksums.digest_file(f) != rec["digest"]:
            raise error(
                f"{f}: the file is corrupted (its {checksums.ALGO} checksum differs); {fix}"
            )
    return True


def check_folder(
    path: str | os.PathLike, error: type[Exception], verify: bool | None = None
) -> str:
    """Check a ``save_pretrained`` folder before it is loaded; return what was checked.

    A meshtrain export is verified against its checksums (every byte). Any other folder
    gets what its format allows: ``config.json`` read strictly (encoding, duplicate keys),
    the index's weight map pointing at files that exist, and every safetensors file's
    header, sizes and dtypes (``check_foreign``)."""
    from meshtrain.files.structured import load_json

    path = Path(path)
    if checksums.verify_default(verify) and verify_export(path, error):
        return "checksums verified"
    config = None
    if (path / "config.json").is_file():
        try:
            json.loads((path / "config.json").read_bytes())
        except (ValueError, RecursionError):
            pass  # not JSON at all: the loader's own diagnosis names file, line and column
        else:  # JSON, but maybe with a key given twice (the last value would win silently)
            config = load_json(
                path / "config.json", error, what="model config", fix="save the model again"
            )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = load_json(index, error, what="weight index", fix="save the model again")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise error(f"{index}: no 'weight_map' object; save the model again")
        for name in sorted(set(weight_map.values())):
            if not isinstance(name, str) or not (path / name).is_file():
                raise error(
                    f"{index}: its weight_map names {name!r}, which is not in {path}; copy "
                    f"the missing shard or save the model again"
                )
    declared = config_dtype(config if isinstance(config, dict) else None)
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        check_foreign(f, error, declared)
    return f"{len(files)} safetensors file(s): header, sizes and dtypes checked"
