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

8-bit (LLM.int8, ``Int8Params``) weights shard the same way (each rank keeps ``1 / N`` of
the int8 codes; the per-row scales ``SCB``, 4 bytes per output row, stay whole), but
bitsandbytes computes with a *second reference* to the codes: ``Linear8bitLt`` moves
``weight.CB`` into ``state.CB`` at its first forward, multiplies with ``state.CB`` (never
``weight``), and after each forward sets ``weight.data = state.CB``. Left alone, that
reference pins the whole int8 matrix on every rank (sharding would save nothing) and
outlives the gathered buffer. So before sharding, :func:`unpin_8bit_codes` moves the
scales into ``state`` (what ``init_8bit_state`` does) and drops both references to the
whole codes; :func:`track_8bit_codes` then points ``state.CB`` at the gathered weight at
the start of every forward (a pre-hook on the linear, which runs inside its unit's
gather). The gathered weight is a view of the unit bucket's buffer, whose storage stage 3
resizes to 0 on release and refills on the next gather (forward or backward), so
``state.CB`` holds no bytes between uses and the whole values while the unit is gathered
-- exactly what autograd's saved views of any gathered weight see.
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


def unpin_8bit_codes(model: nn.Module) -> list[nn.Module]:
    """Drop bitsandbytes' extra references to each ``Int8Params``' whole codes (module
    docstring); returns the 8-bit linear modules."""
    found = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(module, "state", None)
        if type(weight).__name__ != "Int8Params" or state is None:
            continue
        if getattr(weight, "SCB", None) is not None:  # what init_8bit_state moves
            state.SCB = weight.SCB
        weight.CB = weight.SCB = None
        state.CB = None  # set from the gathered weight before each forward
        found.append(module)
    return found


def track_8bit_codes(modules: list[nn.Module]) -> list:
    """Point each 8-bit linear's ``state.CB`` at its (gathered) weight before each forward;
    returns the hook handles. Register after stage 3's gathering hooks."""

    def hook(module, args):
        module.state.CB = module.weight.data

    return [m.register_forward_pre_hook(hook) for m in modules]
