"""The room of transformers' GPT-2 (``model_type`` ``gpt2``): fused ``c_attn`` (q|k|v in
one Conv1D), learned positions, and a forward that reshapes to the full sequence after
``ln_f``."""

from __future__ import annotations

from meshtrain.families.block_plan import BlockPlan
from meshtrain.families.layout import Layout
from meshtrain.families.room import Room
from meshtrain.families.tp_plan import TPPlan

GPT2_SIZES = {"heads": "config.num_attention_heads", "vocab": "config.vocab_size"}
GPT2_BODY = (
    ("transformer.wte", "embedding", "vocab"),
    ("transformer.drop", "scatter_sequence"),  # after the position embeddings are added
    ("transformer.drop", "sequence"),
    ("transformer.h.*.ln_1", "sequence"),
    ("transformer.h.*.attn", "region"),
    ("transformer.h.*.attn.c_attn", "column", "heads", 3),  # fused q|k|v, Conv1D [in, out]
    ("transformer.h.*.attn.c_proj", "row", "heads"),
    ("transformer.h.*.attn.resid_dropout", "sequence"),
    ("transformer.h.*.ln_2", "sequence"),
    ("transformer.h.*.mlp", "region"),
    ("transformer.h.*.mlp.c_fc", "column"),
    ("transformer.h.*.mlp.c_proj", "row"),
    ("transformer.h.*.mlp.dropout", "sequence"),
    ("transformer.ln_f", "gather_sequence"),  # GPT2Model reshapes to the full sequence
)
GPT2_ATTRS = (
    ("transformer.h.*.attn", "num_heads", "heads"),
    ("transformer.h.*.attn", "split_size", "heads"),
    ("transformer.h.*.attn", "embed_dim", "heads"),
)

GPT2 = TPPlan(
    name="gpt2",
    classes=("GPT2LMHeadModel",),
    sizes=GPT2_SIZES,
    rows=(*GPT2_BODY, ("lm_head", "lm_head", "vocab")),  # tied to wte: shares its shard
    attrs=GPT2_ATTRS,
    loss="hf_causal",
)

GPT2_CLASSIFIER = TPPlan(
    name="gpt2 sequence classification",
    classes=("GPT2ForSequenceClassification",),
    sizes=GPT2_SIZES,
    rows=GPT2_BODY,  # ln_f already leaves sequence parallelism; ``score`` stays replicated
    attrs=GPT2_ATTRS,
)

ROOM = Room(
    name="gpt2",
    model_types=("gpt2",),
    tp_plans=(GPT2, GPT2_CLASSIFIER),
    tp_blocks=(
        BlockPlan(
            ("transformers.models.gpt2.modeling_gpt2.GPT2Block",),
            GPT2,
            "transformer.h.*",
            {"heads": "attn.config.num_attention_heads"},
        ),
    ),
    layout=Layout(
        "transformer.h",
        {"transformer.wte": "input", "transformer.wpe": "zero", "transformer.drop": "identity"},
        ("transformer.ln_f", "lm_head", "score"),
        body="transformer",
        reshapes_after="transformer.ln_f",
    ),
    context_types=("gpt2",),
    packing_types=("gpt2",),
)

__all__ = ["GPT2", "GPT2_ATTRS", "GPT2_BODY", "GPT2_CLASSIFIER", "GPT2_SIZES", "ROOM"]
