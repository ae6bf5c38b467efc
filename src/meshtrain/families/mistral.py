"""The room of transformers' Mistral (``model_type`` ``mistral``): Llama's module layout,
so Llama's plans (named "llama") under Mistral's classes, Llama's pipeline layout and
block rows."""

from __future__ import annotations

from dataclasses import replace

from meshtrain.families.block_plan import BlockPlan
from meshtrain.families.config_names import TRANSFORMERS_NAMES
from meshtrain.families.llama import LLAMA, LLAMA_BLOCK_SIZES, LLAMA_CLASSIFIER, LLAMA_LAYOUT
from meshtrain.families.room import Room

MISTRAL = replace(LLAMA, classes=("MistralForCausalLM",))
MISTRAL_CLASSIFIER = replace(LLAMA_CLASSIFIER, classes=("MistralForSequenceClassification",))

ROOM = Room(
    name="mistral",
    model_types=("mistral",),
    tp_plans=(MISTRAL, MISTRAL_CLASSIFIER),
    tp_blocks=(
        BlockPlan(
            ("transformers.models.mistral.modeling_mistral.MistralDecoderLayer",),
            MISTRAL,
            "model.layers.*",
            LLAMA_BLOCK_SIZES,
        ),
    ),
    layout=LLAMA_LAYOUT,
    context_types=("mistral",),
    packing_types=("mistral",),
    activation_types=("mistral",),
    config_names=TRANSFORMERS_NAMES,
)

__all__ = ["MISTRAL", "MISTRAL_CLASSIFIER", "ROOM"]
