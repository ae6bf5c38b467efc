"""A bitsandbytes-quantized model's state dict with its 4-/8-bit weights made float again.

Merging a LoRA adapter into a quantized base (QLoRA's "merged export") must not add the
adapter's delta into packed codes: a 4-bit weight is stored as uint8 bytes holding two
NF4/FP4 codes each (plus ``<name>.weight.absmax``, ``.quant_map``, ``.nested_*`` and
``.quant_state.bitsandbytes__nf4`` entries), an 8-bit one as int8 rows with a per-row
scale ``SCB``. Here each such weight is dequantized with bitsandbytes' own routine
(4-bit: ``functional.dequantize_4bit`` with the module's ``quant_state``; 8-bit:
``CB * SCB / 127``) into its original dtype and shape, and the quantization entries are
dropped, so ``merge_lora`` adds ``scaling x B @ A`` to real weights and plain
``from_pretrained`` (without a quantization config) loads the result. The merged model
is a dequantized one: its base weights carry the 4-bit rounding, not the original
full-precision values (those are gone once the model was loaded in 4 bits).
"""

from __future__ import annotations

import torch
from torch import nn

_QUANT_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state")


def dequantized_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s gathered state dict, same key names) with every
    bitsandbytes weight dequantized and its quantization entries removed."""
    out = dict(state)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        kind = type(weight).__name__
        if kind not in ("Params4bit", "Int8Params"):
            continue
        key = f"{name}.weight"
        if key not in out:
            continue
        if kind == "Params4bit":
            from bitsandbytes.functional import dequantize_4bit

            qs = weight.quant_state
            packed = out[key]
            if getattr(qs, "packing_format_for_cpu", False):
                raise RuntimeError(
                    f"{key}: bitsandbytes repacked this weight for its CPU kernel; save "
                    "before an evaluation pass or in training mode"
                )
            value = dequantize_4bit(packed.to(qs.absmax.device), qs).to(qs.dtype)
        else:
            scb = out.pop(f"{name}.SCB", None)
            if scb is None:
                scb = weight.SCB
            value = out[key].float() * scb.float().unsqueeze(1) / 127.0
            out.pop(f"{name}.weight_format", None)
        out[key] = value.reshape(module.out_features, module.in_features)
        for k in [
            k for k in out if k.startswith(f"{key}.") and k.split(".")[-1].startswith(_QUANT_KEYS)
        ]:
            del out[k]
    return out
