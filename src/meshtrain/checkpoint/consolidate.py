"""Consolidated export: one safetensors file (or a save_pretrained folder) of the full model,
streamed so that memory stays at one chunk, never the model (the command line: ``interop/consolidate_command.py``).

Why hand-write the safetensors container: ``safetensors.torch.save_file`` takes the
whole state dict in memory, which is exactly the cost this export exists to avoid (a
ZeRO-3 checkpoint of a model larger than one machine's RAM). The container is simple and
fully specified: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
(padded with spaces to a multiple of 8), then the raw tensor bytes in header order. Shapes
and dtypes are known from the manifest, so the header is written first and each tensor is
then assembled from the rank files chunk by chunk (``CheckpointReader.iter_chunks``, at
most ``CHUNK_NUMEL`` elements), cast, and appended. The result is re-opened with
safetensors before it replaces ``output`` (write to a temp name, fsync, rename). Each
tensor's bytes are hashed as they are written; the checksums go to
``meshtrain_checksums.json`` in the folder (``<file>.checksums.json`` beside a single
file), which ``meshtrain serve`` and ``tensor_files.verify_export`` check on load.

Peak memory: one chunk read + its cast copy, plus the pages of the rank files mapped for
that chunk (files are released after every chunk) -- about 2-3 x ``CHUNK_NUMEL`` x 4 bytes
whatever the model size. Bytes read: the whole checkpoint's "param" state once (plus
once more for the sha256 check), each alias read again for its copy.

dtype: by default every tensor is written in the model dtype recorded in the meta (the
checkpoint stores fp32 master weights for trainable parameters); ``dtype`` ("fp32",
"bf16", "fp16") casts floating tensors instead and leaves integer/bool buffers alone.

Output: a path ending in ``.safetensors`` gets one file holding every tensor plus each
alias (tied weight) as its own copy. Any other path is a folder: ``model.safetensors``
in it, and, when the meta carries ``hf_config``, ``config.json`` too, without alias keys
(transformers re-ties them; kept when the config says ``tie_word_embeddings: false``), so
``AutoModelForCausalLM.from_pretrained(folder)`` loads it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint import tensor_files
from meshtrain.checkpoint.manifest import dtype_from_name, dtype_name
from meshtrain.checkpoint.reader import CheckpointReader
from meshtrain.dtypes import PRECISIONS, SAFETENSORS_CODES
from meshtrain.errors import CheckpointError
from meshtrain.files import checksums
from meshtrain.files.atomic import atomic_file, write_atomic
from meshtrain.files.writable import check_writable

CHUNK_NUMEL = 1 << 22  # elements per streamed chunk: 16 MiB of fp32


def _plan(
    reader: CheckpointReader, cast: torch.dtype | None, with_aliases: bool
) -> list[tuple[str, str, torch.dtype, tuple[int, ...]]]:
    """``[(output key, canonical name, output dtype, shape)]`` in file order."""
    names = [(n, n) for n in reader.names()]
    if with_aliases:
        names += list(reader.aliases.items())
    plan = []
    for key, canon in names:
        dtype = reader.dtype(canon)
        if cast is not None and dtype.is_floating_point:
            dtype = cast
        plan.append((key, canon, dtype, reader.shape(canon)))
    return plan


def safetensors_header(plan: list[tuple[str, str, torch.dtype, tuple[int, ...]]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for key, _canon, dtype, shape in plan:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[key] = {
            "dtype": SAFETENSORS_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes],
        }
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the spec allows trailing spaces; aligns the data
    return struct.pack("<Q", len(raw)) + raw


def write_streamed(
    reader: Any,
    plan: list[tuple[str, str, torch.dtype, tuple[int, ...]]],
    path: Path,
    progress: bool | None,
    desc: str = "consolidate",
) -> dict[str, Any]:
    """Write ``path``; return its checksum record, hashed from the bytes as they are
    written (``tensor_files``), so the file is not read again. ``reader``: anything with
    ``iter_chunks(name, max_numel=)`` yielding ``(position, 1-D chunk)`` in order and
    ``release()`` (a ``CheckpointReader``; the ranks' exchange of
    ``interop.pretrained_shards``)."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    if sys.byteorder != "little":
        raise CheckpointError(
            "consolidate writes little-endian safetensors; run it on a little-endian machine"
        )
    disable = not sys.stderr.isatty() if progress is None else not progress
    header = safetensors_header(plan)
    record: dict[str, Any] = {
        "algo": checksums.ALGO,
        "header": checksums.digest(header),
        "tensors": {},
    }
    with atomic_file(path, "wb") as f:
        f.write(header)
        for key, canon, dtype, shape in tqdm(plan, desc=desc, unit="tensor", disable=disable):
            expected = torch.Size(shape).numel()
            written, h = 0, checksums.hasher()
            for _pos, chunk in reader.iter_chunks(canon, max_numel=CHUNK_NUMEL):
                data = chunk.to(dtype).contiguous()
                raw = memoryview(data.view(torch.uint8).numpy())
                f.write(raw)
                h.update(raw)
                written += data.numel()
                del chunk, data, raw
                reader.release()  # unmap what this chunk touched: memory stays one chunk
            if written != expected:
                raise CheckpointError(
                    f"consolidate: assembled {written} elements of {canon!r} for {key!r}, "
                    f"expected {expected}"
                )
            record["tensors"][key] = h.hexdigest()
        f.flush()
        record["size"] = f.tell()
        with safe_open(f.name, framework="pt") as check:  # header and offsets are valid
            if len(list(check.keys())) != len(plan):
                raise CheckpointError(f"consolidate: {f.name} does not list every tensor")
    return record


def _cast_arg(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return None
    cast = PRECISIONS.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(cast, str) and cast in ("float32", "bfloat16", "float16"):
        cast = dtype_from_name(cast)
    if cast not in PRECISIONS.values():
        raise CheckpointError(
            f"consolidate: dtype {dtype!r} is not supported; use one of {sorted(PRECISIONS)}"
        )
    return cast


def consolidate(
    checkpoint: str | os.PathLike | CheckpointReader,
    output: str | os.PathLike,
    *,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool | None = None,
) -> Path:
    """Write the full model state dict of a checkpoint to ``output`` (module docstring).

    ``checkpoint``: a save_dir (``tag`` or ``latest`` picks the checkpoint), a tag
    directory, or an open ``CheckpointReader``. ``dtype``: "fp32", "bf16" or "fp16" for
    floating tensors (default: the model dtype in the meta). ``progress``: tqdm bar over
    tensors (default: when stderr is a terminal). Returns the file or folder written.
    """
    reader = (
        checkpoint
        if isinstance(checkpoint, CheckpointReader)
        else CheckpointReader(checkpoint, tag)
    )
    cast = _cast_arg(dtype)
    output = Path(output)
    single = output.suffix == ".safetensors"
    need = sum(entry_bytes(p) for p in _plan(reader, cast, with_aliases=True))
    check_writable(
        output, CheckpointError, what="consolidate output", is_dir=not single, need_bytes=need
    )
    tensor_files.sidecar_of(output).unlink(missing_ok=True)  # stale until the new one lands
    if single:
        output.parent.mkdir(parents=True, exist_ok=True)
        plan = _plan(reader, cast, with_aliases=True)
        record = write_streamed(reader, plan, output, progress)
        tensor_files.write_sidecar(output, {output.name: record})
        return output
    if output.exists() and not output.is_dir():
        raise CheckpointError(
            f"consolidate: {output} is a file; give a path ending in .safetensors for one "
            f"file, or a folder path"
        )
    output.mkdir(parents=True, exist_ok=True)
    hf_config = reader.meta.get("hf_config")
    # transformers re-ties tied weights on load, as save_pretrained assumes; a config
    # that says it does not tie (tie_word_embeddings false) keeps the copies
    reties = hf_config is not None and hf_config.get("tie_word_embeddings", True) is not False
    plan = _plan(reader, cast, with_aliases=not reties)
    files = {
        "model.safetensors": write_streamed(reader, plan, output / "model.safetensors", progress)
    }
    if hf_config is not None:
        config = dict(hf_config)
        cls = reader.meta.get("hf_model_class")
        if cls and not config.get("architectures"):
            config["architectures"] = [cls]
        floats = [d for _, _, d, _ in plan if d.is_floating_point]
        if floats:  # the dtype from_pretrained will default to, as save_pretrained records
            for k in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
                config[k] = dtype_name(floats[0])
        write_atomic(output / "config.json", json.dumps(config, indent=2) + "\n")
        files["config.json"] = tensor_files.plain_record(output / "config.json")
    tensor_files.write_sidecar(output, files)
    return output


def entry_bytes(entry: tuple[str, str, torch.dtype, tuple[int, ...]]) -> int:
    return torch.Size(entry[3]).numel() * torch.empty(0, dtype=entry[2]).element_size()
