"""What each optimizer type costs and needs: state bytes, master layout, implementation.

One row per ``optimizer.type`` (``meshtrain.config.optimizer.OPTIMIZERS``). The estimator
(``meshtrain estimate``), ``engine.memory_report()`` and the ZeRO plan all read it here.

``state_bytes`` is the optimizer's own state per trainable parameter, the fp32 master copy
*not* included (mixed precision adds 4 bytes; in fp32 the weights are the master):

=============  ==========================  ===========================================
type           state bytes / parameter     why
=============  ==========================  ===========================================
Adam, AdamW    8                           m and v in fp32
SGD            0 (4 with momentum)         the momentum buffer
Adagrad        4                           the running sum of squared gradients
Lion           4                           one momentum buffer (bitsandbytes, 32-bit)
AdamW8bit      2 (+ 8 / 256)               m and v in 8 bits, one fp32 absmax per 256
                                           elements of each (bitsandbytes, blockwise)
Lion8bit       1 (+ 4 / 256)               the momentum in 8 bits, blockwise
Adafactor      4 / min(rows, cols) ~ 0     a row and a column factor of v for a matrix
               (4 for vectors)             (r + c floats for r x c); a vector keeps v
=============  ==========================  ===========================================

``layout`` says how the fp32 master chunks are cut into the tensors the optimizer steps
(``meshtrain.parallel.zero.flat_group.LAYOUTS``): element-wise optimizers take any cut;
blockwise 8-bit ones need each parameter's 256-element blocks intact (then a ZeRO shard
steps bit-identically to the whole parameter); Adafactor needs each parameter whole and
in its shape, which ZeRO's flat partitioning cannot give for stage >= 1 over several
ranks (refused by name; ``docs/optimizers.md``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer type: its implementation and its memory per parameter."""

    name: str
    implementation: str  # the class that steps, for messages and docs
    state_bytes: float  # optimizer state per trainable parameter, master excluded
    layout: str  # "flat" | "blocks" | "whole" (module docstring)
    package: str | None = None  # the optional package it needs

    @property
    def elementwise(self) -> bool:
        return self.layout == "flat"


KINDS: dict[str, OptimizerKind] = {
    k.name: k
    for k in (
        OptimizerKind("Adam", "torch.optim.AdamW / Adam", 8, "flat"),
        OptimizerKind("AdamW", "torch.optim.AdamW", 8, "flat"),
        OptimizerKind("SGD", "torch.optim.SGD", 0, "flat"),
        OptimizerKind("Adagrad", "torch.optim.Adagrad", 4, "flat"),
        OptimizerKind("Adafactor", "torch.optim.Adafactor", 0, "whole"),
        OptimizerKind(
            "AdamW8bit", "bitsandbytes.optim.AdamW8bit", 2 + 8 / 256, "blocks", "bitsandbytes"
        ),
        OptimizerKind("Lion", "bitsandbytes.optim.Lion32bit", 4, "flat", "bitsandbytes"),
        OptimizerKind(
            "Lion8bit", "bitsandbytes.optim.Lion8bit", 1 + 4 / 256, "blocks", "bitsandbytes"
        ),
    )
}


def layout_of(optimizer_type: str | None) -> str:
    """The master layout an optimizer type needs ("flat" for unknown / client ones)."""
    kind = KINDS.get(optimizer_type or "")
    return kind.layout if kind is not None else "flat"
