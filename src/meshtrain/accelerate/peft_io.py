"""Saving a prepared model: peft adapters alone, LoRA merged into the base, or whole.

Under ZeRO-3 a module's sharded parameters are empty placeholders, so ``model.save_
pretrained()`` on a rank would write empty tensors (peft#2892, trl#4416). Everything here
therefore takes the *gathered* state dict (``Engine.module_state_dict``, whole on every
rank) and never reads the module's parameters.

Merging LoRA is ``meshtrain.checkpoint.merge_lora``'s, with each layer's scaling read from
the peft module.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn


def is_peft_model(module: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional
        return False
    return isinstance(module, PeftModel)


def merge_lora_state_dict(
    module: nn.Module, state: dict[str, torch.Tensor], adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """The base model's state dict with ``adapter`` merged in (``checkpoint.merge_lora``).
    ``module`` is the PeftModel (read for each layer's scaling only); ``state`` its full,
    gathered state dict."""
    from peft.tuners.lora import LoraLayer

    from meshtrain.interop.dequantize import dequantized_state
    from meshtrain.interop.merge_lora import merge_lora

    # a 4-/8-bit base is dequantized first: never a delta added into packed codes
    state = dequantized_state(module, state)
    layers = {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}
    fan_in_fan_out = any(getattr(m, "fan_in_fan_out", False) for m in layers.values())
    return merge_lora(state, lambda name: layers[name].scaling[adapter], adapter, fan_in_fan_out)


def save_model(
    module: nn.Module, state: dict[str, torch.Tensor], directory: Path, *, merge_lora: bool = False
) -> Path:
    """Write ``module`` from its gathered ``state`` into ``directory`` (main rank only):
    a peft adapter folder (``PeftModel.from_pretrained`` loads it), with ``merge_lora``
    the merged base model (``from_pretrained`` of the base class loads it), else
    accelerate's ``save_model`` file: ``model.safetensors`` of the state dict, a weight the
    module shares under several names (tied embeddings) kept under its first name only,
    as accelerate's ``clean_state_dict_for_safetensors`` keeps it (no ``config.json``:
    accelerate writes none; ``model.save_pretrained`` writes the folder)."""
    directory.mkdir(parents=True, exist_ok=True)
    if is_peft_model(module):
        if merge_lora:
            base = module.get_base_model()
            merged = merge_lora_state_dict(module, state)
            config = base.config
            if getattr(config, "quantization_config", None) is not None:
                config = copy.deepcopy(config)  # the merged weights are dequantized
                del config.quantization_config
            config.save_pretrained(directory)
            _save_safetensors(merged, directory / "model.safetensors")
        else:
            module.save_pretrained(directory, state_dict=state, safe_serialization=True)
        return directory
    _save_safetensors(_first_names(module, state), directory / "model.safetensors")
    return directory


def _first_names(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` less the later names of a tensor ``module`` holds under several names
    (the gathered copies no longer share storage, so sharing is read from the module)."""
    first: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        first.setdefault(id(t), name)
    shared = {n for n, t in module.state_dict(keep_vars=True).items() if first[id(t)] != n}
    return {k: v for k, v in state.items() if k not in shared}


@contextmanager
def whole_for_save(engine, module: nn.Module):
    """Collective (every rank enters): under ZeRO-3, ``module``'s parameters whole and the
    stage-3 hooks paused, so the main rank alone may run it while saving. peft's
    ``save_pretrained`` of prompt / prefix tuning runs the prompt encoder to save its
    embeddings; with the hooks live that is a gather on one rank only, and a hang."""
    gatherer = getattr(getattr(engine, "zero", None), "gatherer", None)
    if gatherer is None or not is_peft_model(module):
        with nullcontext():
            yield
        return
    with gatherer.gathered(module), gatherer.paused():
        yield


def prompt_embeddings(engine, module: nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective (every rank calls it): under ZeRO-3, the embeddings peft's
    ``save_pretrained`` saves for each prompt-learning adapter (prompt / prefix / p-tuning),
    computed by its prompt encoder from whole weights on every rank together. None when
    there is nothing to precompute (not ZeRO-3, not peft, no prompt learning).

    For writers that run on one rank, possibly later (a checkpoint's files, written after
    the commit): ``saved_prompts`` then hands these to peft instead of running the encoder
    on shards, which would be a gather on one rank only, and a hang."""
    gatherer = getattr(getattr(engine, "zero", None), "gatherer", None)
    if gatherer is None or not is_peft_model(module):
        return None
    names = [
        name
        for name, cfg in module.peft_config.items()
        if getattr(cfg, "is_prompt_learning", False) and not getattr(cfg, "inference_mode", False)
    ]
    if not names:
        return None
    with gatherer.gathered(module), gatherer.paused(), torch.no_grad():
        return {name: module.get_prompt_embedding_to_save(name).clone() for name in names}


@contextmanager
def saved_prompts(module: nn.Module, prompts: dict[str, torch.Tensor] | None):
    """Inside, ``module.get_prompt_embedding_to_save(name)`` returns ``prompts[name]`` (from
    ``prompt_embeddings``) without running the encoder; the method is restored after."""
    if not prompts:
        yield
        return
    module.__dict__["get_prompt_embedding_to_save"] = lambda adapter_name: prompts[adapter_name]
    try:
        yield
    finally:
        module.__dict__.pop("get_prompt_embedding_to_save", None)


def _save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()},
        str(path),
        metadata={"format": "pt"},
    )


__all__ = [
    "is_peft_model",
    "merge_lora_state_dict",
    "prompt_embeddings",
    "save_model",
    "saved_prompts",
    "whole_for_save",
]
