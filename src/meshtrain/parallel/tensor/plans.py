"""Tensor-parallel plans: one table per model family, mapping module paths to styles.

A row is ``(path, style)`` or ``(path, style, units)`` or ``(path, style, units, blocks)``;
``*`` in a path matches any characters, dots included (``fnmatch``): ``*.output.dense``
matches ``attention.output.dense`` too, where ``*[0-9].output.dense`` does not; two rows
that replace one module are refused. Styles:

============  ===============================================================================
style         what ``apply_tensor_parallel`` does to the module at ``path``
============  ===============================================================================
embedding     ``nn.Embedding`` -> ``VocabParallelEmbedding`` (vocabulary padded to a multiple
              of T); its output is all-reduced (full sequence on every rank)
embedding_to_sequence
              the same, but with sequence parallelism the output is reduce-scattered to
              this rank's sequence shard (half the bytes of the all-reduce)
column        Linear / Conv1D -> ``ColumnParallelLinear`` (output features sharded)
row           Linear / Conv1D -> ``RowParallelLinear`` (input features sharded)
lm_head       a ``column`` over the vocabulary whose sharded logits feed the vocab-parallel
              loss (``loss`` below); the logits it returns stay sharded
region        the module whose first input enters a column/row region: the input is copied
              (sequence parallel: all-gathered) once for all the column layers inside, and
              dropout inside runs on this rank's own random stream
scatter_sequence
              with sequence parallelism, the module's first input is split along the
              sequence (backward: all-gather); for models that need the full sequence
              before their first block (position ids, masks)
sequence      a module that runs on a sequence shard under sequence parallelism (a norm, a
              dropout): its replicated weights' gradients are summed over the tp group, and
              dropout inside it draws from this rank's own random stream (its tokens differ
              from every other rank's, so must its mask)
per_head      a module applied alike to every attention head (Qwen3's ``q_norm`` and
              ``k_norm``): its weights stay replicated, and since each rank applies it to
              its own heads only, their gradients are summed over the tp group (with or
              without sequence parallelism)
gather_sequence
              with sequence parallelism, the module's first input is all-gathered along the
              sequence (backward: keep this rank's chunk): the model leaves sequence
              parallelism there, for code that needs the full sequence (GPT-2's final
              reshape, BERT's pooler reading token 0); an ``lm_head`` then takes the full
              sequence and copies it into its region instead of all-gathering it
============  ===============================================================================

``units`` names the indivisible unit of the sharded dimension (``"heads"``,
``"kv_heads"``, ``"vocab"``; default: single features), looked up in ``sizes`` (attribute
paths on the model). Grouped-query attention shards its query and output projections by
``"kv_heads"`` too: a unit is then one key/value head's group of query heads, so padding
adds whole groups and every query head stays with its key/value head. ``blocks`` counts fused projections (GPT-2's ``c_attn``: 3). ``attrs``
lists module attributes the forward reads that scale with the local share of a unit
(``num_heads``, GPT-2's ``split_size``): each becomes ``value x local units / units``.

Write a plan for your own model the same way and pass it as ``plan=``::

    MY_PLAN = TPPlan(
        name="mine",
        sizes={"heads": "config.n_heads", "vocab": "config.vocab_size"},
        rows=(
            ("tok", "embedding", "vocab"),
            ("blocks.*.attn", "region"),
            ("blocks.*.attn.qkv", "column", "heads", 3),
            ("blocks.*.attn.out", "row", "heads"),
            ("blocks.*.ff.up", "column"),
            ("blocks.*.ff.down", "row"),
        ),
    )
"""

from __future__ import annotations

from dataclasses import dataclass, field

Row = tuple  # (path, style[, units[, blocks]])
STYLES = (
    "embedding",
    "embedding_to_sequence",
    "scatter_sequence",
    "column",
    "row",
    "lm_head",
    "region",
    "sequence",
    "per_head",
    "gather_sequence",
)


@dataclass(frozen=True)
class TPPlan:
    """A model family's tensor-parallel plan (see the module docstring)."""

    name: str
    rows: tuple[Row, ...]
    sizes: dict[str, str] = field(default_factory=dict)
    attrs: tuple[tuple[str, str, str], ...] = ()
    classes: tuple[str, ...] = ()  # model class names this plan is the default for
    loss: str | None = None  # "decoder", "hf_causal", "hf_masked", "masked_lm" or None
    sequence_parallel: bool = True  # whether the plan supports sequence parallelism

    def __post_init__(self) -> None:
        for row in self.rows:
            if not 2 <= len(row) <= 4 or row[1] not in STYLES:
                raise ValueError(
                    f"plan {self.name!r}: row {row!r} must be (path, style[, units[, blocks]])"
                    f" with style one of {STYLES}"
                )

    @classmethod
    def from_dict(cls, data: dict) -> TPPlan:
        """A plan from config JSON: ``{"rows": [[path, style, ...], ...], "sizes": {...},
        "attrs": [[path, attr, units], ...], "loss": ..., "name": ...}``."""
        from meshtrain.errors import ConfigError

        unknown = set(data) - {"name", "rows", "sizes", "attrs", "loss", "sequence_parallel"}
        if unknown or "rows" not in data:
            raise ConfigError(
                f"tensor_parallel.plan: needs 'rows' and accepts name, sizes, attrs, loss, "
                f"sequence_parallel; got keys {sorted(data)}"
            )
        try:
            return cls(
                name=data.get("name", "config plan"),
                rows=tuple(tuple(r) for r in data["rows"]),
                sizes=dict(data.get("sizes", {})),
                attrs=tuple(tuple(a) for a in data.get("attrs", ())),
                loss=data.get("loss"),
                sequence_parallel=bool(data.get("sequence_parallel", True)),
            )
        except ValueError as exc:
            raise ConfigError(f"tensor_parallel.plan: {exc}") from None


DECODER = TPPlan(
    name="meshtrain decoder",
    classes=("Decoder",),
    sizes={"heads": "config.n_heads", "vocab": "config.vocab_size"},
    rows=(
        ("embed", "embedding_to_sequence", "vocab"),
        ("layers.*.attn_norm", "sequence"),
        ("layers.*.attn", "region"),
        ("layers.*.attn.q_proj", "column", "heads"),
        ("layers.*.attn.k_proj", "column", "heads"),
        ("layers.*.attn.v_proj", "column", "heads"),
        ("layers.*.attn.o_proj", "row", "heads"),
        ("layers.*.mlp_norm", "sequence"),
        ("layers.*.mlp", "region"),
        ("layers.*.mlp.gate_proj", "column"),
        ("layers.*.mlp.up_proj", "column"),
        ("layers.*.mlp.down_proj", "row"),
        ("norm", "sequence"),
        ("lm_head", "lm_head", "vocab"),
    ),
    attrs=(("layers.*.attn", "n_heads", "heads"),),
    loss="decoder",
)

_LLAMA_SIZES = {
    "heads": "config.num_attention_heads",
    "kv_heads": "config.num_key_value_heads",
    "vocab": "config.vocab_size",
}
_LLAMA_BODY = (
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

LLAMA = TPPlan(  # also Qwen2 and Mistral: the same module layout
    name="llama",
    classes=("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"),
    sizes=_LLAMA_SIZES,
    rows=(*_LLAMA_BODY, ("lm_head", "lm_head", "vocab")),
    loss="hf_causal",
)

LLAMA_MOE = TPPlan(  # Llama-style attention; the MoE block at ``mlp`` stays whole
    name="llama-style mixture of experts",
    classes=("MixtralForCausalLM", "Qwen2MoeForCausalLM"),
    sizes=_LLAMA_SIZES,
    # the mlp rows shard Qwen-MoE's dense layers (``mlp_only_layers``); MoE blocks are
    # skipped whatever the rows say (``moe_blocks``)
    rows=(*_LLAMA_BODY, ("lm_head", "lm_head", "vocab")),
    loss="hf_causal",
)

QWEN3_MOE = TPPlan(  # as LLAMA_MOE, plus the per-head query/key norms
    name="qwen3 mixture of experts",
    classes=("Qwen3MoeForCausalLM",),
    sizes=_LLAMA_SIZES,
    rows=(
        *_LLAMA_BODY,
        ("model.layers.*.self_attn.q_norm", "per_head"),
        ("model.layers.*.self_attn.k_norm", "per_head"),
        ("lm_head", "lm_head", "vocab"),
    ),
    loss="hf_causal",
)

LLAMA_CLASSIFIER = TPPlan(
    name="llama sequence classification",
    classes=(
        "LlamaForSequenceClassification",
        "Qwen2ForSequenceClassification",
        "MistralForSequenceClassification",
    ),
    sizes=_LLAMA_SIZES,
    # the head pools the last non-padding token: it reads the full sequence, and its
    # few (hidden x labels) weights stay replicated; the model computes its own loss
    rows=(*_LLAMA_BODY, ("score", "gather_sequence")),
)

_GPT2_SIZES = {"heads": "config.num_attention_heads", "vocab": "config.vocab_size"}
_GPT2_BODY = (
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
_GPT2_ATTRS = (
    ("transformer.h.*.attn", "num_heads", "heads"),
    ("transformer.h.*.attn", "split_size", "heads"),
    ("transformer.h.*.attn", "embed_dim", "heads"),
)

GPT2 = TPPlan(
    name="gpt2",
    classes=("GPT2LMHeadModel",),
    sizes=_GPT2_SIZES,
    rows=(*_GPT2_BODY, ("lm_head", "lm_head", "vocab")),  # tied to wte: shares its shard
    attrs=_GPT2_ATTRS,
    loss="hf_causal",
)

GPT2_CLASSIFIER = TPPlan(
    name="gpt2 sequence classification",
    classes=("GPT2ForSequenceClassification",),
    sizes=_GPT2_SIZES,
    rows=_GPT2_BODY,  # ln_f already leaves sequence parallelism; ``score`` stays replicated
    attrs=_GPT2_ATTRS,
)

_BERT_SIZES = {"heads": "config.num_attention_heads", "vocab": "config.vocab_size"}
# post-norm: each norm and dropout after a row layer runs on a shard. ``*[0-9].output``
# is BertOutput; ``*.output`` alone would also match ``attention.output``.
_BERT_ENCODER = (
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
_BERT_ATTRS = (
    ("*encoder.layer.*.attention.self", "num_attention_heads", "heads"),
    ("*encoder.layer.*.attention.self", "all_head_size", "heads"),
)

BERT = TPPlan(
    name="bert",
    classes=("BertModel", "BertForSequenceClassification"),
    sizes=_BERT_SIZES,
    rows=(*_BERT_ENCODER, ("*pooler", "gather_sequence")),  # the pooler reads token 0
    attrs=_BERT_ATTRS,
)

BERT_TOKENS = TPPlan(
    name="bert token classification",
    classes=("BertForTokenClassification",),
    sizes=_BERT_SIZES,
    rows=(*_BERT_ENCODER, ("dropout", "gather_sequence")),  # the labels cover every token
    attrs=_BERT_ATTRS,
)

BERT_MLM = TPPlan(
    name="bert masked lm",
    classes=("BertForMaskedLM",),
    sizes=_BERT_SIZES,
    rows=(
        *_BERT_ENCODER,
        ("cls.predictions.transform", "sequence"),  # dense + LayerNorm on a sequence shard
        ("cls.predictions.decoder", "lm_head", "vocab"),  # tied to word_embeddings
    ),
    attrs=_BERT_ATTRS,
    loss="masked_lm",  # BertForMaskedLM computes its loss inline: recomputed vocab-parallel
)

PLANS: tuple[TPPlan, ...] = (
    DECODER, LLAMA, LLAMA_MOE, QWEN3_MOE, LLAMA_CLASSIFIER, GPT2, GPT2_CLASSIFIER, BERT,
    BERT_TOKENS, BERT_MLM,
)  # fmt: skip


def plan_for(model: object) -> TPPlan | None:
    """The built-in plan whose ``classes`` name ``model``'s class, else the plan a model
    assembles itself from its layers (``tensor_parallel_plan()``: a PipelineModule's,
    ``layer_plans``), else None."""
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        return own()
    name = type(model).__name__
    for plan in PLANS:
        if name in plan.classes:
            return plan
    return None


def sample_names(model, limit: int = 12) -> list[str]:
    """Names of the first ``limit`` linear / embedding / Conv1D modules (for messages)."""
    from torch import nn

    from meshtrain.parallel.tensor.layers import is_conv1d

    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) or is_conv1d(m)
    ]
    return names[:limit] + (["..."] if len(names) > limit else [])


def no_plan_message(model) -> str:
    """The error for a model without a plan: its module names and how to write one."""
    names = sample_names(model, limit=16)
    return (
        f"tensor parallelism has no plan for {type(model).__name__} (built-in plans: the "
        f"meshtrain decoder, Llama/Qwen2/Mistral, Mixtral/Qwen2-MoE/Qwen3-MoE, GPT-2, "
        f"BERT). Its linear and embedding "
        f"modules are: {', '.join(names)}. Write a plan naming them, e.g.\n"
        "    from meshtrain.parallel.tensor import TPPlan\n"
        "    plan = TPPlan(name='mine', sizes={'heads': 'config.n_heads'}, rows=(\n"
        "        ('blocks.*.attn', 'region'),\n"
        "        ('blocks.*.attn.q_proj', 'column', 'heads'), ... ,\n"
        "        ('blocks.*.attn.out_proj', 'row', 'heads'),\n"
        "        ('blocks.*.mlp.up', 'column'), ('blocks.*.mlp.down', 'row')))\n"
        "and pass it as meshtrain.initialize(..., tp_plan=plan) or apply_tensor_parallel("
        "model, topology, config, plan=plan) (see docs/tensor_parallel.md)"
    )


__all__ = [
    "BERT",
    "BERT_MLM",
    "BERT_TOKENS",
    "DECODER",
    "GPT2",
    "GPT2_CLASSIFIER",
    "LLAMA",
    "LLAMA_CLASSIFIER",
    "LLAMA_MOE",
    "PLANS",
    "QWEN3_MOE",
    "TPPlan",
    "no_plan_message",
    "plan_for",
    "sample_names",
]
