"""A torch.distributed.checkpoint (DCP) folder as a source the engine's loader reads
element ranges from (FSDP2's ``dcp.save``, torchtitan's checkpoints).

The folder (torch 2.x ``FileSystemWriter``) holds ``.metadata`` (read by
:mod:`~meshtrain.interop.dcp_metadata`, never with a plain unpickler) and one or more
``__<rank>_<n>.distcp`` files, each a run of ``torch.save`` archives, one per chunk, at
the ``(offset, length)`` the metadata gives. A tensor's chunks are boxes of its global
shape (``offsets``, ``sizes``): FSDP2 writes each rank's ``Shard(0)`` rows, tensor
parallelism other dimensions; the boxes tile the tensor.

Keys. DCP flattens the state dict the script passed, so the same model appears as

* torchtitan: the model's keys at the top (``model.layers.0.mlp.up_proj.weight``) beside
  ``optimizer`` (``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``:
  ``optimizer.state.<fqn>.exp_avg``, ``optimizer.param_groups.<fqn>.lr``),
  ``lr_scheduler`` and ``train_state``;
* a plain FSDP2 script's ``{"model": model_sd, "optimizer": optim_sd}``
  (``get_state_dict``): ``model.<fqn>`` and ``optimizer.state.<fqn>.exp_avg``,
  ``optimizer.param_groups.<i>.lr``.

The model's prefix is found from the model's own names (the one prefix under which its
tensors are all present), the optimizer's from ``<p>state.`` beside ``<p>param_groups``.

Reading ``[start, start + n)`` of a flattened tensor: the rows ``[r0, r1)`` of dim 0
that hold the range are assembled from the chunks that meet them (each chunk read whole,
one at a time, through a :class:`FileWindow`), and the range is cut from that block.
Memory per read: the block (the range plus at most two rows) and one chunk (at most the
largest tensor). A rank reads only the chunks its own layout's ranges meet.

What carries over: weights, AdamW's ``exp_avg`` / ``exp_avg_sq`` and ``step``, the
optimizer hyper-parameters, the step count (``train_state.step`` when torchtitan wrote
one, else the optimizer's ``step``), and the scheduler's position when a torch
scheduler's ``last_epoch`` is saved under ``lr_scheduler``. Not in DCP's files, so left as
they are: RNG streams, a data-loader position. Refused by name: a chunk's bytes beyond its
file's end (a truncated ``.distcp``), a missing ``.distcp``, chunks stored through a DCP
stream extension (compression), a model whose tensors are missing or shaped otherwise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import CheckpointError
from meshtrain.interop.dcp_metadata import METADATA, read_metadata
from meshtrain.interop.deepspeed_source import HYPER  # torch's hyper-parameter names
from meshtrain.interop.file_window import FileWindow

# Where a torch LR scheduler's ``last_epoch`` (its step() count) may sit.
SCHEDULER_KEYS = ("lr_scheduler.last_epoch", "scheduler.last_epoch")
TRAIN_STEP_KEY = "train_state.step"


def is_dcp_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a DCP checkpoint's metadata."""
    return (folder / METADATA).is_file()


def dcp_folder(load_dir: Path, tag: str | None) -> Path | None:
    """The DCP folder ``load_dir`` itself, ``load_dir/tag``, or the tag ``load_dir/latest``
    names (meshtrain's DCP saves keep a ``latest``); None when there is none."""
    if tag is None and is_dcp_folder(load_dir):
        return load_dir
    if tag is None:
        latest = load_dir / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8").strip()
    folder = load_dir / str(tag)
    return folder if is_dcp_folder(folder) else None


class DcpSource:
    """One DCP checkpoint folder, read by element ranges in the model's own names."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path = Path(folder)
        md = read_metadata(self.path)
        self.entries: dict[str, Any] = dict(md.state_dict_metadata)
        self._where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for index, info in md.storage_data.items():
            offset = None if index.offset is None else tuple(int(o) for o in index.offset)
            self._where[(index.fqn, offset)] = info
        self._fds: dict[str, int] = {}
        self._check_files()
        self.optim_prefix = self._optimizer_prefix()
        self.model_prefix: str | None = None
        self.aliases: dict[str, str] = {}
        self.fallback: dict[str, torch.Tensor] = {}  # from_pretrained's missing keys

    # --- files ----------------------------------------------------------------------

    def _check_files(self) -> None:
        """Every chunk's bytes lie inside its file (checked before anything is read, so a
        cut checkpoint is named, never half-loaded)."""
        need: dict[str, tuple[int, str]] = {}
        for (fqn, _), info in self._where.items():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{self.path}: {fqn!r} is stored through a DCP stream extension "
                    f"({info.transform_descriptors}), which meshtrain does not read; save "
                    "the checkpoint without _extensions"
                )
            end = int(info.offset) + int(info.length)
            if end > need.get(info.relative_path, (0, ""))[0]:
                need[info.relative_path] = (end, fqn)
        for rel, (end, fqn) in sorted(need.items()):
            file = self.path / rel
            if not file.is_file():
                raise CheckpointError(
                    f"{file}: missing (the DCP metadata places {fqn!r} in it); copy every "
                    ".distcp file of the checkpoint into the folder"
                )
            size = file.stat().st_size
            if size < end:
                raise CheckpointError(
                    f"{file}: truncated ({size} of at least {end} bytes; {fqn!r} ends past "
                    "its end); copy the DCP checkpoint again from where it was written"
                )

    def _fd(self, rel: str) -> int:
        if rel not in self._fds:
            self._fds[rel] = os.open(self.path / rel, os.O_RDONLY)
        return self._fds[rel]

    def _load_item(self, fqn: str, offset: tuple[int, ...] | None) -> Any:
        """One stored item: a chunk tensor, or a pickled value (``weights_only``)."""
        info = self._where.get((fqn, offset))
        if info is None:
            raise CheckpointError(
                f"{self.path / METADATA}: no storage entry for {fqn!r} at {offset}; the "
                "metadata is damaged: copy the checkpoint again"
            )
        window = FileWindow(self._fd(info.relative_path), int(info.offset), int(info.length))
        try:
            return torch.load(window, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a zip or unpickling error: damaged bytes
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(
                f"{self.path / info.relative_path}: {fqn!r} cannot be read ({text[:120]}); "
                "the file is damaged or needs code to load: copy the DCP checkpoint again"
            ) from None

    # --- keys -----------------------------------------------------------------------

    def _optimizer_prefix(self) -> str | None:
        groups = {k for k in self.entries if "param_groups" in k}
        for key in self.entries:
            parts = key.split(".")
            for i, part in enumerate(parts[:-2]):
                if part != "state":
                    continue
                prefix = ".".join(parts[:i]) + ("." if i else "")
                if any(g.startswith(prefix + "param_groups") for g in groups):
                    return prefix
        return None

    def _tensor_keys(self) -> list[str]:
        skip = (self.optim_prefix or "\0") + "state."
        return [
            k
            for k, v in self.entries.items()
            if type(v).__name__ == "TensorStorageMetadata" and not k.startswith(skip)
        ]

    def use_names(self, names) -> None:
        """Find the model's prefix from its own names (module docstring)."""
        names = sorted(names)
        keys = set(self._tensor_keys())
        counts: dict[str, int] = {}
        for n in names[:8]:
            for k in keys:
                if k.endswith(n) and (len(k) == len(n) or k[-len(n) - 1] == "."):
                    counts.setdefault(k[: len(k) - len(n)], 0)
        for prefix in counts:
            counts[prefix] = sum(prefix + n in keys for n in names)
        self.model_prefix = max(counts, key=counts.get) if counts else ""

    def keys(self) -> list[str]:
        """The model's tensor names (``use_names`` first: the prefix taken off)."""
        prefix = self.model_prefix or ""
        return [k[len(prefix) :] for k in self._tensor_keys() if k.startswith(prefix)]

    def convert(self, model_type: str | None) -> None:
        """transformers' load-time conversions: none for DCP, which holds the model's keys."""

    def use_aliases(self, aliases: Mapping[str, str]) -> None:
        self.aliases = dict(aliases)

    def _key(self, name: str, state: str = "param") -> str | None:
        for n in (name, *self._aliases_of(name)):
            if state == "param":
                key = (self.model_prefix or "") + n
            else:
                key = f"{self.optim_prefix}state.{n}.{state}"
            if key in self.entries:
                return key
        return None

    def _aliases_of(self, name: str) -> list[str]:
        out = [a for a, c in self.aliases.items() if c == name]
        if name in self.aliases:
            out.append(self.aliases[name])
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        key = self._key(name)
        if key is None:
            raise CheckpointError(
                f"{self.path}: the DCP checkpoint has no tensor {name!r}; load it into the "
                "model that saved it"
            )
        return tuple(int(d) for d in self.entries[key].size)

    def check_model(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        if self.model_prefix is None:
            self.use_names(expected)
        wrong = []
        for name, shape in expected.items():
            key = self._key(name)
            if key is None:
                if name not in self.fallback:
                    wrong.append(f"{name} (missing)")
                continue
            have = tuple(int(d) for d in self.entries[key].size)
            if have != tuple(shape):
                wrong.append(f"{name} {have} != {tuple(shape)}")
        if wrong:
            raise CheckpointError(
                f"{self.path / METADATA}: this DCP checkpoint is of another model "
                f"({len(wrong)} tensors differ: {', '.join(wrong[:3])}); load it into the "
                "model that saved it"
            )

    def states(self) -> list[str]:
        if self.optim_prefix is None:
            return ["param"]
        first = f"{self.optim_prefix}state."
        names: list[str] = []
        for key, entry in self.entries.items():
            if not key.startswith(first) or type(entry).__name__ != "TensorStorageMetadata":
                continue
            state = key.rsplit(".", 1)[1]
            if len(entry.size) > 0 and state not in names:
                names.append(state)
        return ["param", *names]

    # --- element ranges -------------------------------------------------------------

    def read(self, name: str, state: str = "param", start: int = 0, numel: int | None = None):
        key = self._key(name, state)
        if key is None:
            if state == "param" and name in self.fallback:
                flat = self.fallback[name].reshape(-1)
                numel = flat.numel() - start if numel is None else numel
                return flat[start : start + numel].clone()
            raise CheckpointError(
                f"{self.path}: the DCP checkpoint has no {state!r} of {name!r} (it holds "
                f"{self.states()}); resume with load_optimizer_states=False to keep the "
                "weights and start the optimizer fresh"
            )
        entry = self.entries[key]
        shape = tuple(int(d) for d in entry.size)
        full = math.prod(shape)
        numel = full - start if numel is None else numel
        if not shape:
            return self._load_item(key, ()).reshape(-1)[start : start + numel].clone()
        inner = math.prod(shape[1:])
        r0, r1 = start // inner, -(-(start + numel) // inner)
        block = torch.empty((r1 - r0, *shape[1:]), dtype=entry.properties.dtype)
        for chunk in entry.chunks:
            off = tuple(int(o) for o in chunk.offsets)
            size = tuple(int(s) for s in chunk.sizes)
            lo, hi = max(r0, off[0]), min(r1, off[0] + size[0])
            if lo >= hi:
                continue
            data = self._load_item(key, off)
            if tuple(data.shape) != size:
                raise CheckpointError(
                    f"{self.path}: the chunk of {key!r} at {off} holds {tuple(data.shape)}, "
                    f"the metadata says {size}; the checkpoint is damaged: copy it again"
                )
            where = (slice(lo - r0, hi - r0),) + tuple(
                slice(o, o + s) for o, s in zip(off[1:], size[1:], strict=True)
            )
            block[where] = data[lo - off[0] : hi - off[0]]
            del data  # one chunk at a time
        first = start - r0 * inner
        return block.reshape(-1)[first : first + numel].clone()

    def read_into(self, name: str, start: int, out: torch.Tensor) -> bool:
        """Elements ``[start, start + out.numel())`` of the weights ``name`` straight into
        ``out`` (a contiguous CPU tensor) when every chunk they meet is a block of whole
        rows (FSDP2's ``Shard(0)`` and torchtitan's layout): then a chunk's elements are one
        run of the flat index and each is copied once, from the loaded chunk into ``out``.
        False, reading nothing, for other chunk boxes (a column cut): ``read`` assembles
        those."""
        key = self._key(name, "param")
        if key is None or out.device.type != "cpu" or not out.is_contiguous():
            return False
        entry = self.entries[key]
        shape = tuple(int(d) for d in entry.size)
        if not shape:
            return False
        inner, end = math.prod(shape[1:]), start + out.numel()
        met = []
        for chunk in entry.chunks:
            off = tuple(int(o) for o in chunk.offsets)
            size = tuple(int(x) for x in chunk.sizes)
            lo, hi = off[0] * inner, (off[0] + size[0]) * inner
            if hi <= start or lo >= end:
                continue
            if any(off[1:]) or size[1:] != shape[1:]:
                return False  # not whole rows: the elements are not one run
            met.append((off, size, lo, hi))
        flat = out.reshape(-1)
        for off, size, lo, hi in met:
            data = self._load_item(key, off)
            if tuple(data.shape) != size:
                raise CheckpointError(
                    f"{self.path}: the chunk of {key!r} at {off} holds {tuple(data.shape)}, "
                    f"the metadata says {size}; the checkpoint is damaged: copy it again"
                )
            a, b = max(lo, start), min(hi, end)
            flat[a - start : b - start] = data.reshape(-1)[a - lo : b - lo]
            del data  # one chunk at a time
        return True

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        if self._key(name, state) is None and state == "param" and name in self.fallback:
            return self.fallback[name].clone()
        return self.read(name, state).reshape(self.shape(name))

    def _value(self, key: str) -> Any:
        """A pickled value, or a whole tensor (small ones: steps, counters), by DCP key."""
        entry = self.entries[key]
        if type(entry).__name__ != "TensorStorageMetadata":
            return self._load_item(key, None)
        shape = tuple(int(d) for d in entry.size)
        if not shape:
            return self._load_item(key, ())
        out = torch.empty(shape, dtype=entry.properties.dtype)
        for chunk in entry.chunks:
            off = tuple(int(o) for o in chunk.offsets)
            size = tuple(int(s) for s in chunk.sizes)
            box = tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))
            out[box] = self._load_item(key, off)
        return out

    # --- the rest of the reader interface -------------------------------------------

    def _step(self) -> float | None:
        if self.optim_prefix is None:
            return None
        first = f"{self.optim_prefix}state."
        key = next((k for k in self.entries if k.startswith(first) and k.endswith(".step")), None)
        return None if key is None else float(self._value(key))

    def _param_groups(self) -> list[dict[str, Any]]:
        if self.optim_prefix is None:
            return []
        base = f"{self.optim_prefix}param_groups."
        groups: dict[str, dict[str, Any]] = {}
        for key in self.entries:
            if not key.startswith(base):
                continue
            group, hyper = key[len(base) :].rsplit(".", 1)
            if hyper in HYPER:
                groups.setdefault(group, {})[hyper] = key
        if not groups:
            return []
        if all(g.isdigit() for g in groups):  # get_state_dict's groups, in order
            order = sorted(groups, key=int)
        else:  # flattened per parameter (torchtitan): the first parameter's group
            order = [next(iter(groups))]
        out = []
        for g in order:
            values = {h: self._value(k) for h, k in groups[g].items()}
            out.append({h: (list(v) if isinstance(v, tuple) else v) for h, v in values.items()})
        return out

    @property
    def world_size(self) -> int | None:
        return None  # DCP keeps no RNG streams of meshtrain's: nothing per rank to restore

    @property
    def meta(self) -> dict[str, Any]:
        steps = None
        if TRAIN_STEP_KEY in self.entries:
            steps = int(self._value(TRAIN_STEP_KEY))
        if steps is None:
            step = self._step()
            steps = 0 if step is None else int(step)
        return {
            "global_steps": steps,
            "micro_steps": None,  # not kept: the loader counts this run's gas
            "skipped_steps": 0,
            "data_loader": None,
            "client_state": {},
        }

    def rank_state(self, rank: int) -> dict[str, Any]:
        step = self._step()
        scheduler = None
        for key in SCHEDULER_KEYS:
            if key in self.entries:  # torch's step() count; meshtrain's is that minus one
                scheduler = {"last_batch_iteration": int(self._value(key)) - 1}
                break
        return {
            "optimizer_step": [] if step is None else [step],
            "param_groups": self._param_groups(),
            "scaler": None,
            "scheduler": scheduler,
        }

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> DcpSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["DcpSource", "dcp_folder", "is_dcp_folder"]
