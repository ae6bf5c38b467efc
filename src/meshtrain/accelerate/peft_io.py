"""Saving a prepared model: peft adapters alone, LoRA merged into the base, or whole.

Under ZeRO-3 a module's sharded parameters are empty placeholders, so ``model.save_
pretrained()`` on a rank would write empty tensors (peft#2892, trl#4416). Everything here
therefore takes the *gathered* state dict (``Engine.module_state_dict``, whole on every
rank) and never reads the module's parameters.

Merging LoRA: for each LoRA layer with base weight ``W`` (out x in), ``A`` (r x in),
``B`` (out x r) and ``scaling = lora_alpha / r`` (peft's ``layer.scaling[adapter]``)::

    W_merged = W + scaling * (B @ A)        (transposed when fan_in_fan_out)

and the keys lose peft's wrapping (``base_model.model.`` prefix, ``.base_layer``; a
module in ``modules_to_save``, e.g. a classifier head, keeps its trained copy), so the
result is the base model's own state dict that plain ``from_pretrained`` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."


def is_peft_model(module: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional
        return False
    return isinstance(module, PeftModel)


def merge_lora_state_dict(
    module: nn.Module, state: dict[str, torch.Tensor], adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """The base model's state dict with ``adapter`` merged in (module docstring).
    ``module`` is the PeftModel (read for each layer's scaling only); ``state`` its full,
    gathered state dict."""
    from peft.tuners.lora import LoraLayer

    merged = dict(state)
    for name, layer in module.named_modules():
        if not isinstance(layer, LoraLayer) or adapter not in layer.scaling:
            continue
        a = merged.pop(f"{name}.lora_A.{adapter}.weight")
        b = merged.pop(f"{name}.lora_B.{adapter}.weight")
        key = f"{name}.base_layer.weight"
        w = merged[key]
        delta = (b.float() @ a.float()) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        merged[key] = (w.float() + delta.reshape(w.shape)).to(w.dtype)
    out = {}
    saved = f".modules_to_save.{adapter}."
    for key, value in merged.items():
        if ".lora_" in key or ".modules_to_save." in key and saved not in key:
            continue  # other adapters' weights
        if ".original_module." in key:
            continue  # the frozen copy of a module the adapter trains (modules_to_save)
        key = key.replace(saved, ".")
        if key.startswith(PEFT_PREFIX):
            key = key[len(PEFT_PREFIX) :]
        out[key.replace(".base_layer.", ".")] = value
    return out


def save_model(
    module: nn.Module, state: dict[str, torch.Tensor], directory: Path, *, merge_lora: bool = False
) -> Path:
    """Write ``module`` from its gathered ``state`` into ``directory`` (main rank only):
    a peft adapter folder (``PeftModel.from_pretrained`` loads it), with ``merge_lora``
    the merged base model (``from_pretrained`` of the base class loads it), a
    ``save_pretrained`` folder for other transformers models, else ``model.safetensors``."""
    directory.mkdir(parents=True, exist_ok=True)
    if is_peft_model(module):
        if merge_lora:
            base = module.get_base_model()
            merged = merge_lora_state_dict(module, state)
            base.config.save_pretrained(directory)
            _save_safetensors(merged, directory / "model.safetensors")
        else:
            module.save_pretrained(directory, state_dict=state, safe_serialization=True)
        return directory
    if hasattr(module, "config") and hasattr(module.config, "save_pretrained"):
        module.config.save_pretrained(directory)
    _save_safetensors(state, directory / "model.safetensors")
    return directory


def _save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()},
        str(path),
        metadata={"format": "pt"},
    )


__all__ = ["is_peft_model", "merge_lora_state_dict", "save_model"]
