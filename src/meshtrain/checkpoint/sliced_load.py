"""``meshtrain.from_pretrained``: each rank reads only the slices its layout keeps.

``transformers``' own ``from_pretrained`` materialises the whole model on every rank and
the engine then cuts it (tensor parallelism) or partitions it (ZeRO-3), so N ranks on one
machine hold N copies for a moment. Here:

1. **Build without storage.** The model is constructed under transformers'
   ``no_init_weights`` (no initialiser runs), so each parameter is a ``torch.empty``
   allocation whose pages are never touched: the kernel backs them with nothing, and the
   process's RSS does not grow by the model. (Not the ``meta`` device: the layout code
   -- TP slicing, ZeRO-3 flattening, the pipeline split -- copies from the tensors it is
   given, and untouched pages read as zeros without becoming resident.)
2. **Missing keys and buffers as transformers does.** Keys of the model that the
   checkpoint lacks are reported like transformers reports them and initialised by the
   model's own ``initialize_weights`` (``_init_weights`` of the modules that own them
   only: loaded tensors are marked ``_is_hf_initialized`` first, transformers' own
   flag); non-persistent buffers (rotary tables, position ids) are computed by the
   constructors as usual; tied weights are tied by the constructor and loaded once.
   Unexpected keys are reported and skipped. A shape mismatch is an error naming the key.
   The initialised missing tensors are rank 0's on every rank (one broadcast of those
   only): the engine's start-up broadcast of the whole model is skipped
   (``meshtrain_weights_from_files``), as every rank reads the same files.
3. **Apply the layout.** ``meshtrain.initialize`` with the given config: TP plan,
   pipeline split, ZeRO partition, exactly as for a model loaded whole.
4. **Read this rank's slices.** The engine's checkpoint loader
   (``engine_io.load(load_module_only=True)``) asks a *source* for the element ranges
   this rank owns, in the unsplit model's names. :class:`SafetensorsSource` serves them
   from a ``save_pretrained`` folder (``model.safetensors`` or a sharded
   ``model.safetensors.index.json``) or one ``.safetensors`` file (``meshtrain
   consolidate``'s export), reading only the rows that cover each range
   (``safe_open(...).get_slice``); a meshtrain checkpoint folder is read by its own
   ``CheckpointReader``. Values are copied, never recomputed, so the result is bitwise
   the tensors transformers would load.

Memory per rank: its partition or shard of every parameter (fp32 masters under ZeRO),
plus at most one tensor's covering rows at a time while reading, plus the missing keys'
initialised tensors (small heads, when any).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import CheckpointError
from meshtrain.files.structured import load_json

log = logging.getLogger("meshtrain")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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
        self._handles: dict[Path, Any] = {}
        self._last: str | None = None
        if self._file_of is None:
            self._file_of = {k: self._single for k in self._open(self._single).keys()}
        self.fallback = dict(fallback or {})  # missing keys: the model's initialised values
        self.aliases: dict[str, str] = {}
        self.meta: dict[str, Any] = {}
        self.world_size = 0  # never the engine's: no RNG states to restore

    # the checkpoint reader's interface, as engine_io._load uses it -----------------------
    def _open(self, file: Path):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def states(self) -> list[str]:
        return ["param"]

    def rank_state(self, rank: int) -> dict[str, Any]:  # noqa: ARG002 - reader's API
        return {}

    def check_model(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Only shape mismatches are errors here (missing and unexpected keys were
        reported, and the missing ones initialised, before the layout was applied)."""
        bad = [
            f"{n}: checkpoint {self.shape(n)} vs model {tuple(s)}"
            for n, s in expected.items()
            if n in self._file_of and self.shape(n) != tuple(s)
        ]
        if bad:
            raise CheckpointError(
                f"{self.path} does not match the model: shape mismatches ({len(bad)}): "
                + "; ".join(bad[:5])
                + ". Fix: build the model from this checkpoint's config.json"
            )

    def _name(self, name: str) -> str | None:
        if name in self._file_of:
            return name
        for alias, canon in self.aliases.items():  # a tied weight saved under another name
            if canon == name and alias in self._file_of:
                return alias
        return None

    def read(self, name: str, state: str = "param", start: int = 0, numel: int | None = None):
        """Elements ``[start, start + numel)`` of the flattened tensor, reading only the
        rows (first-dimension slices) that cover them."""
        key = self._name(name)
        if key is None:
            full = self.fallback[name].reshape(-1)
            numel = full.numel() - start if numel is None else numel
            return full[start : start + numel].clone()
        if key != self._last:
            # the pages a read touched stay mapped, and count in RSS, while a handle is
            # open: drop them when the loader moves to another tensor
            self._handles.clear()
            self._last = key
        sl = self._open(self._file_of[key]).get_slice(key)
        shape = sl.get_shape()
        total = 1
        for d in shape:
            total *= d
        numel = total - start if numel is None else numel
        if len(shape) == 0:
            return sl[...].reshape(-1)[start : start + numel]
        row = total // shape[0] if shape[0] else 1
        r0, r1 = start // row, -(-(start + numel) // row)
        rows = sl[r0:r1].reshape(-1)
        return rows[start - r0 * row : start - r0 * row + numel]

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        key = self._name(name)
        if key is None:
            return self.fallback[name].clone()
        self._handles.clear()  # as in read(): unmap what the previous tensor touched
        self._last = None
        return self._open(self._file_of[key]).get_tensor(key)

    def close(self) -> None:
        self._handles.clear()  # safetensors unmaps a file when its handle goes

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _hf_config_and_class(path: Path, config_kwargs: dict, model_class):
    """(transformers config, model class) for a folder, a file beside its config.json, or
    a meshtrain checkpoint (``meta.hf_config`` / ``hf_model_class``)."""
    import transformers

    folder = path if path.is_dir() else path.parent
    if (folder / "manifest.json").is_file() or (folder / "latest").is_file():
        from meshtrain.checkpoint.reader import CheckpointReader

        with CheckpointReader(folder) as r:
            meta = r.meta
        if "hf_config" not in meta:
            raise CheckpointError(
                f"{folder}: this meshtrain checkpoint holds no transformers config (it was "
                "not saved from a transformers model); build the model and use "
                "engine.load_checkpoint"
            )
        cfg = dict(meta["hf_config"])
        hf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg, **config_kwargs)
        cls = model_class or getattr(transformers, meta.get("hf_model_class", ""), None)
    else:
        hf = transformers.AutoConfig.from_pretrained(folder, **config_kwargs)
        archs = getattr(hf, "architectures", None) or []
        cls = model_class or (getattr(transformers, archs[0], None) if archs else None)
    if cls is None:
        raise CheckpointError(
            f"{path}: cannot tell which transformers class to build (config.architectures is "
            "empty); pass model_class=, e.g. transformers.AutoModelForCausalLM"
        )
    return hf, cls


def _build_empty(cls, hf_config) -> torch.nn.Module:
    """The model with untouched (never initialised) parameter storage."""
    from transformers.initialization import no_init_weights

    with no_init_weights():  # Auto* classes build through from_config
        model = cls.from_config(hf_config) if cls.__name__.startswith("Auto") else cls(hf_config)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # no_init_weights skips init_weights, which also ties
    return model


def loading_info(model: torch.nn.Module, source_keys: set[str]) -> dict[str, list[str]]:
    """transformers' ``missing_keys`` / ``unexpected_keys`` of ``model`` against a
    checkpoint's keys (tied weights count as present when one of them is)."""
    state = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for k, t in state.items():
        by_id.setdefault(id(t), []).append(k)
    missing = [
        k
        for k, t in state.items()
        if k not in source_keys and not any(o in source_keys for o in by_id[id(t)])
    ]
    unexpected = sorted(k for k in source_keys if k not in state)
    return {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": []}


def from_pretrained(
    path: str | os.PathLike,
    config: dict | str | None = None,
    *,
    model_class=None,
    output_loading_info: bool = False,
    config_kwargs: dict | None = None,
    **initialize_kwargs: Any,
):
    """Build a transformers model laid out by ``config`` and load each rank's slices of
    ``path`` (see the module docstring). Every rank calls it.

    ``path``: a ``save_pretrained`` folder (sharded index or one file), a ``.safetensors``
    file beside its ``config.json`` (``meshtrain consolidate``'s export), or a meshtrain
    checkpoint folder saved from a transformers model (the model weights only).
    ``config``: the engine config, as for ``meshtrain.initialize``; ``model_class``: the
    transformers class (default: ``config.architectures[0]``); ``config_kwargs``:
    overrides of the transformers config. Further keywords go to ``meshtrain.initialize``.

    Returns what ``meshtrain.initialize`` returns (``engine, optimizer, dataloader,
    lr_scheduler``); with ``output_loading_info`` also transformers' loading-info dict
    (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``).
    """
    import meshtrain
    from meshtrain.checkpoint import engine_io

    path = Path(path)
    hf_config, cls = _hf_config_and_class(path, dict(config_kwargs or {}), model_class)
    model = _build_empty(cls, hf_config)
    meshtrain_ckpt = path.is_dir() and (
        (path / "manifest.json").is_file() or (path / "latest").is_file()
    )
    source = None if meshtrain_ckpt else SafetensorsSource(path)
    info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    if source is not None:
        info = loading_info(model, set(source.keys()))
        _initialize_missing(model, info["missing_keys"])
        source.fallback = {
            k: v.detach().clone()
            for k, v in model.state_dict().items()
            if k in info["missing_keys"]
        }
        _report(model, path, info)
    # every rank reads the same bytes next: the engine's start-up broadcast of rank 0's
    # weights would only write the whole model on every other rank
    model.meshtrain_weights_from_files = True
    if initialize_kwargs.get("model_parameters") is None:
        initialize_kwargs["model_parameters"] = model.parameters()
    out = meshtrain.initialize(model=model, config=config, **initialize_kwargs)
    engine = out[0]
    if source is None:
        engine_io.load(engine, path, load_module_only=True)
    else:
        _same_fallback(engine, source.fallback)
        with source:
            names = engine_io.model_names(engine)
            source.aliases = dict(names.aliases)
            engine_io._load(engine, source, False, False, True)
    return (out, info) if output_loading_info else out


def _same_fallback(engine, fallback: dict[str, torch.Tensor]) -> None:
    """Missing keys were initialised on each rank with its own RNG: rank 0's values for
    all (the start-up broadcast that would have done it is skipped)."""
    world = engine.topology.group("world")
    if world.size == 1 or world.pg is None:
        return
    from meshtrain.distributed import comm

    for key in sorted(fallback):
        comm.broadcast(fallback[key], 0, world, label="init")


def _initialize_missing(model: torch.nn.Module, missing: list[str]) -> None:
    """transformers' rule: everything loaded is marked initialised, then the model's
    ``initialize_weights`` runs ``_init_weights`` on the modules still unmarked (those
    owning missing keys) -- and on nothing else, so no other page is touched."""
    missing_set = set(missing)
    for k, t in model.state_dict(keep_vars=True).items():
        if k not in missing_set:
            t._is_hf_initialized = True
    if not missing_set:
        model._is_hf_initialized = True
        return
    with torch.no_grad():
        model.initialize_weights()


def _report(model: torch.nn.Module, path: Path, info: dict[str, list[str]]) -> None:
    name = type(model).__name__
    if info["unexpected_keys"]:
        log.warning(
            "Some weights of the model checkpoint at %s were not used when initializing %s: %s",
            path,
            name,
            info["unexpected_keys"],
        )
    if info["missing_keys"]:
        log.warning(
            "Some weights of %s were not initialized from the model checkpoint at %s and are "
            "newly initialized: %s\nYou should probably TRAIN this model on a down-stream task "
            "to be able to use it for predictions and inference.",
            name,
            path,
            info["missing_keys"],
        )


__all__ = ["SafetensorsSource", "from_pretrained", "loading_info"]
