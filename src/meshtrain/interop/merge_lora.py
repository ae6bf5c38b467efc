"""Merge LoRA adapters into their base weights: ``meshtrain consolidate --merge-lora``.

For each LoRA layer with base weight ``W`` (out x in), ``A`` (r x in), ``B`` (out x r)::

    W_merged = W + scaling x (B @ A)      (transposed when fan_in_fan_out)
    scaling  = lora_alpha / r             (lora_alpha / sqrt(r) with use_rslora)

and the keys lose peft's wrapping (``base_model.model.`` prefix, ``.base_layer``; a module
in ``modules_to_save``, e.g. a classifier head, keeps its trained copy), so the result is
the base model's own state dict that plain ``from_pretrained`` loads.

Unlike the streamed ``consolidate``, this reads the whole model into memory once (LoRA
checkpoints are of models meant to fit one machine). ``alpha_pattern`` / ``rank_pattern``
(per-layer scalings) are refused rather than merged wrongly.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from meshtrain.errors import CheckpointError
from meshtrain.files.structured import load_json

PEFT_PREFIX = "base_model.model."


def merge_lora(
    state: dict[str, torch.Tensor],
    scaling: Callable[[str], float],
    adapter: str = "default",
    fan_in_fan_out: bool = False,
) -> dict[str, torch.Tensor]:
    """The base model's state dict with ``adapter`` merged in; ``scaling(layer_name)``
    gives each LoRA layer's scaling (module docstring)."""
    merged = dict(state)
    suffix = f".lora_A.{adapter}.weight"
    for key_a in [k for k in state if k.endswith(suffix)]:
        name = key_a[: -len(suffix)]
        a = merged.pop(key_a)
        b = merged.pop(f"{name}.lora_B.{adapter}.weight")
        key = f"{name}.base_layer.weight"
        w = merged[key]
        delta = (b.float() @ a.float()) * scaling(name)
        if fan_in_fan_out:
            delta = delta.T
        merged[key] = (w.float() + delta.reshape(w.shape)).to(w.dtype)
    out = {}
    saved = f".modules_to_save.{adapter}."
    for key, value in merged.items():
        if ".lora_" in key or (".modules_to_save." in key and saved not in key):
            continue  # other adapters' weights
        if ".original_module." in key:
            continue  # the frozen copy of a module the adapter trains (modules_to_save)
        key = key.replace(saved, ".")
        if key.startswith(PEFT_PREFIX):
            key = key[len(PEFT_PREFIX) :]
        out[key.replace(".base_layer.", ".")] = value
    return out


def read_adapter_config(path: str | os.PathLike) -> dict:
    """``adapter_config.json`` (or the folder holding it, as ``save_pretrained`` writes)."""
    path = Path(path)
    if path.is_dir():
        path = path / "adapter_config.json"
    if not path.is_file():
        raise CheckpointError(
            f"--merge-lora: {path} does not exist; give the adapter_config.json of the LoRA "
            "(or the adapter folder that save_model/save_pretrained wrote)"
        )
    fix = "save the adapter again with save_pretrained"
    cfg = load_json(path, CheckpointError, what="adapter config", fix=fix, empty_fix=fix)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"--merge-lora: {path} is not a JSON object; {fix}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"--merge-lora: {path} is a {cfg['peft_type']} adapter, not LoRA")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise CheckpointError(
                f"--merge-lora: {path} sets {key} (per-layer scalings), which this merge does "
                "not implement; merge with peft's merge_and_unload instead"
            )
    return cfg


def consolidate_merged(
    checkpoint, output: str | os.PathLike, adapter_config: str | os.PathLike, tag: str | None = None
) -> Path:
    """Write the merged model of an engine checkpoint of a peft LoRA model to the folder
    ``output`` (``model.safetensors`` + ``config.json`` when the checkpoint has one)."""
    from safetensors.torch import save_file

    from meshtrain.checkpoint.reader import CheckpointReader

    cfg = read_adapter_config(adapter_config)
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    reader = (
        checkpoint
        if isinstance(checkpoint, CheckpointReader)
        else CheckpointReader(checkpoint, tag)
    )
    state = {n: reader.read_full(n) for n in reader.names()}
    if not any(".lora_A." in k for k in state):
        raise CheckpointError(f"--merge-lora: the checkpoint {checkpoint} holds no LoRA weights")
    merged = merge_lora(state, lambda _name: scale, fan_in_fan_out=bool(cfg.get("fan_in_fan_out")))
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in merged.items()},
        str(output / "model.safetensors"),
        metadata={"format": "pt"},
    )
    hf_config = reader.meta.get("hf_config")
    if hf_config is not None:
        (output / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return output


__all__ = ["consolidate_merged", "merge_lora", "read_adapter_config"]
