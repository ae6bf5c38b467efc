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
   (``engine.checkpoint_load.load(load_module_only=True)``) asks a *source* for the element ranges
   this rank owns, in the unsplit model's names. :class:`SafetensorsSource` serves them
   from a ``save_pretrained`` folder (``model.safetensors`` or a sharded
   ``model.safetensors.index.json``) or one ``.safetensors`` file (``meshtrain
   consolidate``'s export), reading exactly each range's bytes with ``pread`` (no
   memory map: see :class:`_SafetensorsFile`); a torch DCP folder by :class:`DcpSource`
   (each rank the chunks its ranges meet); a meshtrain checkpoint folder by its own
   ``CheckpointReader``. Values are copied, never recomputed, so the result is bitwise
   the tensors transformers would load.

Memory per rank: its partition or shard of every parameter (fp32 masters under ZeRO),
plus one read range at a time (at most one tensor), plus the missing keys' initialised
tensors (small heads, when any). The layout must not write what the loader overwrites:
the parameters read from files are marked ``meshtrain_values_follow``, so tensor
parallelism makes their shards as untouched allocations instead of copies of untouched
pages (which would make every copied page resident: one more slice per rank), and
ZeRO-3 copies each parameter's owned part straight into the rank's shard.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

import meshtrain  # initialize from the root: interop sits above the engine, never below
from meshtrain.errors import CheckpointError
from meshtrain.interop.dcp_source import DcpSource, dcp_folder
from meshtrain.interop.safetensors_source import SafetensorsSource

log = logging.getLogger("meshtrain")


def _hf_config_and_class(path: Path, config_kwargs: dict, model_class):
    """(transformers config, model class) for a folder, a file beside its config.json, or
    a meshtrain checkpoint (``meta.hf_config`` / ``hf_model_class``)."""
    import transformers

    folder = path if path.is_dir() else path.parent
    if dcp_folder(folder, None) is not None:  # DCP keeps no config: beside it, or above
        near = [
            f
            for f in (folder, folder.parent, folder.parent.parent)
            if (f / "config.json").is_file()
        ]
        if not near:
            raise CheckpointError(
                f"{folder}: a DCP checkpoint holds no model config; save the model's "
                "config.json into this folder or the one above it "
                "(model.config.save_pretrained(folder))"
            )
        folder = near[0]
        hf = transformers.AutoConfig.from_pretrained(folder, **config_kwargs)
        archs = getattr(hf, "architectures", None) or []
        cls = model_class or (getattr(transformers, archs[0], None) if archs else None)
    elif (folder / "manifest.json").is_file() or (folder / "latest").is_file():
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
    file beside its ``config.json`` (``meshtrain consolidate``'s export), a meshtrain
    checkpoint folder saved from a transformers model (the model weights only), or a
    torch DCP folder (FSDP2, torchtitan, ``checkpoint.format: dcp``; the weights only)
    with the model's ``config.json`` in it or in the folder above.
    ``config``: the engine config, as for ``meshtrain.initialize``; ``model_class``: the
    transformers class (default: ``config.architectures[0]``); ``config_kwargs``:
    overrides of the transformers config. Further keywords go to ``meshtrain.initialize``.

    Returns what ``meshtrain.initialize`` returns (``engine, optimizer, dataloader,
    lr_scheduler``); with ``output_loading_info`` also transformers' loading-info dict
    (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``).
    """
    path = Path(path)
    hf_config, cls = _hf_config_and_class(path, dict(config_kwargs or {}), model_class)
    model = _build_empty(cls, hf_config)
    dcp = dcp_folder(path, None) if path.is_dir() else None
    meshtrain_ckpt = (
        dcp is None
        and path.is_dir()
        and ((path / "manifest.json").is_file() or (path / "latest").is_file())
    )
    if dcp is not None:  # torch DCP (FSDP2, torchtitan): the model's keys under a prefix
        source = DcpSource(dcp)
        source.use_names(model.state_dict())
    else:
        source = None if meshtrain_ckpt else SafetensorsSource(path)
    info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    if source is not None:
        source.convert(getattr(getattr(model, "config", None), "model_type", None))
        info = loading_info(model, set(source.keys()))
        _check_no_conversion(model, path, info)
    _mark_values_follow(model, info["missing_keys"])
    if source is not None:
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
        engine.load_checkpoint(path, load_module_only=True)
    else:
        _same_fallback(engine, source.fallback)
        with source:  # the engine's loader reads this rank's ranges from the folder
            engine.load_checkpoint(
                source,
                load_optimizer_states=False,
                load_lr_scheduler_states=False,
                load_module_only=True,
            )
    for t in engine.module.parameters():  # loaded: the mark no longer holds
        if hasattr(t, VALUES_FOLLOW):
            delattr(t, VALUES_FOLLOW)
    return (out, info) if output_loading_info else out


VALUES_FOLLOW = "meshtrain_values_follow"


def _mark_values_follow(model: torch.nn.Module, missing: list[str]) -> None:
    """Mark the parameters whose every element the loader writes after the layout is
    applied (all but the missing keys', which are initialised here): the layout need not
    carry their (untouched, all-zero) values, and copying them would make each copied
    page resident (see ``meshtrain.parallel.tensor.layers._shard_param``)."""
    state = model.state_dict(keep_vars=True)
    initialised = {id(state[k]) for k in missing}
    for p in model.parameters():
        if id(p) not in initialised:
            setattr(p, VALUES_FOLLOW, True)


def _check_no_conversion(model, path: Path, info: dict) -> None:
    """transformers 5 converts some checkpoints on load (``conversion_mapping``: e.g.
    Mixtral's and Qwen-MoE's experts stored one tensor per expert, fused into one 3-D
    tensor in the model; ``save_pretrained`` writes them back per expert). Slices of the
    fused tensors are not in the files, and loading without the conversion would leave
    them freshly initialised: refused by name instead."""
    if not info["missing_keys"] or not info["unexpected_keys"]:
        return
    import re

    from transformers.conversion_mapping import WeightConverter, get_checkpoint_conversion_mapping

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    rules = get_checkpoint_conversion_mapping(model_type) if model_type else None
    sources = [
        re.escape(pat).replace(r"\*", r"\d+")
        for rule in rules or ()
        if isinstance(rule, WeightConverter)
        for pat in rule.source_patterns
    ]
    hit = next((k for k in info["unexpected_keys"] for pat in sources if re.search(pat, k)), None)
    if hit is not None:
        raise CheckpointError(
            f"{path}: {model_type} checkpoint tensors such as {hit!r} are converted by "
            "transformers on load (fused into the model's experts tensors), which "
            "meshtrain.from_pretrained does not do yet; load this model with transformers' "
            "from_pretrained and pass it to meshtrain.initialize"
        )


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
