"""bitsandbytes-quantized frozen weights (QLoRA's 4-bit base) under ZeRO stage 3.

Stage 3 packs a frozen ``Params4bit`` (its packed uint8 NF4/FP4 codes, two per byte) into
a frozen group like any frozen weight: each of ``N`` ranks keeps ``1 / N`` of the packed
bytes (``zero.frozen``; the ``quant_state`` -- absmax per 64 weights, the code book, the
shape -- is small and stays whole on every rank). Gathering writes the codes back into a
temporary buffer that the parameter's ``.data`` views.

One bitsandbytes behaviour breaks that: on CPU, ``Linear4bit.forward`` in eval mode with
no gradient (and an AVX512-BF16 CPU) *repacks* the weight once into a kernel-friendly
layout, replacing ``weight.data`` with a new tensor and flagging ``quant_state``
(``packing_format_for_cpu``, absmax turned into bf16). Stage 3 would never see the new
tensor: the next gather brings back the old layout under the new flag, and every later
step computes with scrambled weights (measured before this module: the loss left the
single-process reference at the second step). So before stage 3 shards them, every
repacked weight is converted back (bitsandbytes' own inverse) and the repacking is
switched off for those modules (``support_avx512bf16_for_cpu = False``): they use the
generic 4-bit path, as in training mode.
"""

from __future__ import annotations

from torch import nn


def is_quantized(param) -> bool:
    """A bitsandbytes 4-bit or 8-bit weight (checked by class name: no import)."""
    return type(param).__name__ in ("Params4bit", "Int8Params")


def keep_4bit_layout_fixed(model: nn.Module) -> int:
    """Undo and disable bitsandbytes' CPU repacking of 4-bit weights (module docstring).
    Returns the number of 4-bit linear modules seen."""
    seen = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ != "Params4bit":
            continue
        seen += 1
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                weight.data, state
            )
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return seen
