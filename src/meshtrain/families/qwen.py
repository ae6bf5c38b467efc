"""The room of transformers' dense Qwen models: Qwen2 (``qwen2``) and Qwen3 (``qwen3``).

Qwen2 has Llama's module layout, so it runs the Llama plans (named "llama") under its own
classes, Llama's pipeline layout and Llama's block rows. Qwen3 is known only to packing
and to the activation estimate: its per-head query/key norms would need ``per_head`` rows
(as ``QWEN3_MOE`` has) and context parallelism has not been proven on it, so tensor and
context parallelism refuse it by name.
"""

from __future__ import annotations

from dataclasses import replace

from meshtrain.families.block_plan import BlockPlan
from meshtrain.families.config_names import TRANSFORMERS_NAMES
from meshtrain.families.llama import LLAMA, LLAMA_BLOCK_SIZES, LLAMA_CLASSIFIER, LLAMA_LAYOUT
from meshtrain.families.room import Room

QWEN2 = replace(LLAMA, classes=("Qwen2ForCausalLM",))
QWEN2_CLASSIFIER = replace(LLAMA_CLASSIFIER, classes=("Qwen2ForSequenceClassification",))

ROOM = Room(
    name="qwen",
    model_types=("qwen2", "qwen3"),
    tp_plans=(QWEN2, QWEN2_CLASSIFIER),
    tp_blocks=(
        BlockPlan(
            ("transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer",),
            QWEN2,
            "model.layers.*",
            LLAMA_BLOCK_SIZES,
        ),
    ),
    layout=LLAMA_LAYOUT,
    context_types=("qwen2",),
    packing_types=("qwen2", "qwen3"),
    activation_types=("qwen2", "qwen3"),
    config_names=TRANSFORMERS_NAMES,
)

__all__ = ["QWEN2", "QWEN2_CLASSIFIER", "ROOM"]
