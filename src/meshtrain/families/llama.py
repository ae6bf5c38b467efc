"""The room of transformers' Llama (``model_type`` ``llama``).

Its module layout (``model.layers.*.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``model.embed_tokens``, ``model.norm``) is the one Qwen2, Mistral, Mixtral and the Qwen
MoE models share: their rooms take ``LLAMA_BODY``, ``LLAMA_SIZES`` and ``LLAMA_LAYOUT``
from here, and say so.
"""

from __future__ import annotations

from meshtrain.families.block_plan import BlockPlan
from meshtrain.families.config_names import TRANSFORMERS_NAMES
from meshtrain.families.layout import Layout
from meshtrain.families.room import Room
from meshtrain.families.tp_plan import TPPlan

LLAMA_SIZES = {
    "heads": "config.num_attention_heads",
    "kv_heads": "config.num_key_value_heads",
    "vocab": "config.vocab_size",
}
LLAMA_BODY = (
    ("model.embed_tokens", "embedding", "vocab"),
    ("model.layers.0", "scatter_sequence"),  # positions and mask come from the full length
    ("model.layers.*.input_layernorm", "sequence"),
    ("model.layers.*.self_attn", "region"),
    ("model.layers.*.self_attn.q_proj", "column", "kv_heads"),  # by key/value group
    ("model.layers.*.self_attn.k_proj", "column", "kv_heads"),
    ("model.layers.*.self_attn.v_proj", "column", "kv_heads"),
    ("model.layers.*.self_attn.o_proj", "row", "kv_heads"),
    ("model.layers.*.post_attention_layernorm", "sequence"),
    ("model.layers.*.mlp", "region"),
    ("model.layers.*.mlp.gate_proj", "column"),
    ("model.layers.*.mlp.up_proj", "column"),
    ("model.layers.*.mlp.down_proj", "row"),
    ("model.norm", "sequence"),
)
# a block inside a PipelineModule reads its head counts from its attention's config
LLAMA_BLOCK_SIZES = {
    "heads": "self_attn.config.num_attention_heads",
    "kv_heads": "self_attn.config.num_key_value_heads",
}
LLAMA_LAYOUT = Layout(
    "model.layers",
    {"model.embed_tokens": "input"},
    ("model.norm", "lm_head", "score"),
    body="model",
)

# the plan is named for the layout: Qwen2's and Mistral's are this one under their classes
LLAMA = TPPlan(
    name="llama",
    classes=("LlamaForCausalLM",),
    sizes=LLAMA_SIZES,
    rows=(*LLAMA_BODY, ("lm_head", "lm_head", "vocab")),
    loss="hf_causal",
)

LLAMA_CLASSIFIER = TPPlan(
    name="llama sequence classification",
    classes=("LlamaForSequenceClassification",),
    sizes=LLAMA_SIZES,
    # the head pools the last non-padding token: it reads the full sequence, and its
    # few (hidden x labels) weights stay replicated; the model computes its own loss
    rows=(*LLAMA_BODY, ("score", "gather_sequence")),
)

ROOM = Room(
    name="llama",
    model_types=("llama",),
    tp_plans=(LLAMA, LLAMA_CLASSIFIER),
    tp_blocks=(
        BlockPlan(
            ("transformers.models.llama.modeling_llama.LlamaDecoderLayer",),
            LLAMA,
            "model.layers.*",
            LLAMA_BLOCK_SIZES,
        ),
    ),
    layout=LLAMA_LAYOUT,
    context_types=("llama",),
    packing_types=("llama",),
    activation_types=("llama",),
    config_names=TRANSFORMERS_NAMES,
)

__all__ = [
    "LLAMA",
    "LLAMA_BLOCK_SIZES",
    "LLAMA_BODY",
    "LLAMA_CLASSIFIER",
    "LLAMA_LAYOUT",
    "LLAMA_SIZES",
    "ROOM",
]
