"""A torch.distributed.checkpoint (DCP) ``.metadata`` file, read without running code.

DCP (torch 2.x, ``filesystem.py``: ``FileSystemWriter.finish``) writes the checkpoint's
table as ``pickle.dump(Metadata)``: for every flattened key (``model.layers.0.mlp.up_proj
.weight``, ``optimizer.state.<fqn>.exp_avg``, ...) either a ``TensorStorageMetadata``
(dtype, global size, the chunks as boxes of ``offsets`` and ``sizes``) or a
``BytesStorageMetadata`` (a pickled value), and in ``storage_data`` where each chunk sits:
``MetadataIndex(fqn, offset) -> _StorageInfo(relative_path, offset, length)``.

A plain ``pickle.load`` would import and call whatever the file names. Here the file goes
through an unpickler whose ``find_class`` answers only the names such a file holds
(:data:`ALLOWED`: DCP's own metadata dataclasses, ``torch.Size``, torch dtypes and
layouts, ``pathlib``'s path, which ``StorageMeta.checkpoint_id`` is); every other name is
refused with the file, the name and what to do. The classes are torch's own (plain
dataclasses whose ``__setstate__`` only assigns fields), so the result is the object
torch's reader would build.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import CheckpointError

METADATA = ".metadata"
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"

# (module, name) pairs a DCP metadata file may name, and why each is harmless.
ALLOWED: dict[tuple[str, str], str] = {
    (DCP_METADATA_MODULE, "Metadata"): "the table itself (a dataclass)",
    (DCP_METADATA_MODULE, "TensorStorageMetadata"): "a tensor's dtype, size, chunks",
    (DCP_METADATA_MODULE, "BytesStorageMetadata"): "a pickled value's entry (no fields)",
    (DCP_METADATA_MODULE, "ChunkStorageMetadata"): "one chunk's offsets and sizes",
    (DCP_METADATA_MODULE, "TensorProperties"): "dtype and layout flags (assigning setstate)",
    (DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): "an Enum of three memory formats",
    (DCP_METADATA_MODULE, "MetadataIndex"): "a (key, offset) lookup key",
    (DCP_METADATA_MODULE, "StorageMeta"): "checkpoint id and save id strings",
    (DCP_FILESYSTEM_MODULE, "_StorageInfo"): "a chunk's file, offset and length",
    ("torch", "Size"): "a tuple of ints",
    ("torch.serialization", "_get_layout"): "looks a layout up by name",
    ("pathlib", "PosixPath"): "the checkpoint id DCP records (a path)",
    ("pathlib", "WindowsPath"): "the same, written on Windows",
}
# torch dtypes are pickled by name (``torch float32``); every one is a constant.
DTYPE_NAMES = frozenset(
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
)


class DcpMetadataUnpickler(pickle.Unpickler):
    """The restricted unpickler of a DCP ``.metadata`` file (module docstring)."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in DTYPE_NAMES:
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return layout_named
        if (module, name) in ALLOWED:
            if module == DCP_METADATA_MODULE:
                import torch.distributed.checkpoint.metadata as dcp_metadata

                return getattr(dcp_metadata, name)
            if module == DCP_FILESYSTEM_MODULE:
                import torch.distributed.checkpoint.filesystem as dcp_filesystem

                return getattr(dcp_filesystem, name)
            if module == "pathlib":
                return path_text
            return torch.Size
        raise CheckpointError(
            f"{self.path}: the DCP metadata pickle names {module}.{name}, which is not one "
            "of the DCP metadata classes meshtrain reads, and meshtrain never imports or runs "
            "what a checkpoint names; re-save the checkpoint with "
            "torch.distributed.checkpoint.save, or load it with torch where it is trusted"
        )


def layout_named(name: str) -> torch.layout:
    """``torch.serialization._get_layout``: a layout constant by its name, nothing else."""
    layout = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise CheckpointError(f"DCP metadata: {name!r} is not a torch layout")
    return layout


def path_text(*parts: str) -> str:
    """A pickled ``pathlib`` path as its text (only DCP's ``checkpoint_id`` is one)."""
    return "/".join(str(p) for p in parts).replace("//", "/")


def read_metadata(folder: str | Path):
    """The ``Metadata`` of the DCP checkpoint in ``folder``, read with the restricted
    unpickler; a missing, truncated or foreign file is refused in one line."""
    path = Path(folder) / METADATA
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: a DCP checkpoint is complete only once its .metadata is "
            "written (the last step of torch.distributed.checkpoint.save); copy the whole "
            "folder again, or save it again"
        )
    data = path.read_bytes()
    try:
        md = DcpMetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - EOFError, UnpicklingError, ...: a cut or damaged file
        raise CheckpointError(
            f"{path}: cannot be read as DCP metadata ({type(exc).__name__}: "
            f"{str(exc)[:120]}); it is truncated or damaged: copy the checkpoint again"
        ) from None
    if type(md).__name__ != "Metadata" or not isinstance(
        getattr(md, "state_dict_metadata", None), dict
    ):
        raise CheckpointError(
            f"{path}: holds a {type(md).__name__}, not DCP's Metadata; point at the folder "
            "torch.distributed.checkpoint.save wrote"
        )
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointError(
            f"{path}: the DCP metadata has no storage table (written by another storage "
            "writer than FileSystemWriter); save it with a FileSystemWriter"
        )
    return md


__all__ = ["ALLOWED", "METADATA", "DcpMetadataUnpickler", "read_metadata"]
