"""The room of transformers' BERT (``model_type`` ``bert``): a post-norm encoder, so each
norm and dropout after a row layer runs on a sequence shard; the pooler reads token 0."""

from __future__ import annotations

from meshtrain.families.layout import Layout
from meshtrain.families.room import Room
from meshtrain.families.tp_plan import TPPlan

BERT_SIZES = {"heads": "config.num_attention_heads", "vocab": "config.vocab_size"}
# post-norm: each norm and dropout after a row layer runs on a shard. ``*[0-9].output``
# is BertOutput; ``*.output`` alone would also match ``attention.output``.
BERT_ENCODER = (
    ("*embeddings.word_embeddings", "embedding", "vocab"),
    ("*embeddings.LayerNorm", "scatter_sequence"),  # after position/type embeddings
    ("*embeddings.LayerNorm", "sequence"),
    ("*embeddings.dropout", "sequence"),
    ("*encoder.layer.*.attention.self", "region"),
    ("*encoder.layer.*.attention.self.query", "column", "heads"),
    ("*encoder.layer.*.attention.self.key", "column", "heads"),
    ("*encoder.layer.*.attention.self.value", "column", "heads"),
    ("*encoder.layer.*.attention.output.dense", "row", "heads"),
    ("*encoder.layer.*.attention.output.dropout", "sequence"),
    ("*encoder.layer.*.attention.output.LayerNorm", "sequence"),
    ("*encoder.layer.*.intermediate.dense", "column"),
    ("*encoder.layer.*[0-9].output.dense", "row"),
    ("*encoder.layer.*[0-9].output.dropout", "sequence"),
    ("*encoder.layer.*[0-9].output.LayerNorm", "sequence"),
)
BERT_ATTRS = (
    ("*encoder.layer.*.attention.self", "num_attention_heads", "heads"),
    ("*encoder.layer.*.attention.self", "all_head_size", "heads"),
)

BERT = TPPlan(
    name="bert",
    classes=("BertModel", "BertForSequenceClassification"),
    sizes=BERT_SIZES,
    rows=(*BERT_ENCODER, ("*pooler", "gather_sequence")),  # the pooler reads token 0
    attrs=BERT_ATTRS,
)

BERT_TOKENS = TPPlan(
    name="bert token classification",
    classes=("BertForTokenClassification",),
    sizes=BERT_SIZES,
    rows=(*BERT_ENCODER, ("dropout", "gather_sequence")),  # the labels cover every token
    attrs=BERT_ATTRS,
)

BERT_MLM = TPPlan(
    name="bert masked lm",
    classes=("BertForMaskedLM",),
    sizes=BERT_SIZES,
    rows=(
        *BERT_ENCODER,
        ("cls.predictions.transform", "sequence"),  # dense + LayerNorm on a sequence shard
        ("cls.predictions.decoder", "lm_head", "vocab"),  # tied to word_embeddings
    ),
    attrs=BERT_ATTRS,
    loss="masked_lm",  # BertForMaskedLM computes its loss inline: recomputed vocab-parallel
)

ROOM = Room(
    name="bert",
    model_types=("bert",),
    tp_plans=(BERT, BERT_TOKENS, BERT_MLM),
    layout=Layout(
        "bert.encoder.layer",
        {"bert.embeddings": "input"},
        ("bert.pooler", "cls", "classifier"),
        body="bert",
    ),
)

__all__ = ["BERT", "BERT_ATTRS", "BERT_ENCODER", "BERT_MLM", "BERT_SIZES", "BERT_TOKENS", "ROOM"]
