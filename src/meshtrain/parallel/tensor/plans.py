"""Tensor-parallel plans: one table per model family, mapping module paths to styles.

A row is ``(path, style)`` or ``(path, style, units)`` or ``(path, style, units, blocks)``;
``*`` in a path matches one name (a layer index). Styles:

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
sequence      a module with replicated weights (a norm) that runs on a sequence shard under
              sequence parallelism; its weight gradients are summed over the tp group
============  ===============================================================================

``units`` names the indivisible unit of the sharded dimension (``"heads"``,
``"kv_heads"``, ``"vocab"``; default: single features), looked up in ``sizes`` (attribute
paths on the model); ``blocks`` counts fused projections (GPT-2's ``c_attn``: 3). ``attrs``
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
)


@dataclass(frozen=True)
class TPPlan:
    """A model family's tensor-parallel plan (see the module docstring)."""

    name: str
    rows: tuple[Row, ...]
    sizes: dict[str, str] = field(default_factory=dict)
    attrs: tuple[tuple[str, str, str], ...] = ()
    classes: tuple[str, ...] = ()  # model class names this plan is the default for
    loss: str | None = None  # "decoder", "hf_causal", "hf_masked" or None
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

LLAMA = TPPlan(  # also Qwen2 and Mistral: the same module layout
    name="llama",
    classes=("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"),
    sizes={
        "heads": "config.num_attention_heads",
        "kv_heads": "config.num_key_value_heads",
        "vocab": "config.vocab_size",
    },
    rows=(
        ("model.embed_tokens", "embedding", "vocab"),
        ("model.layers.0", "scatter_sequence"),  # positions and mask come from the full length
        ("model.layers.*.input_layernorm", "sequence"),
        ("model.layers.*.self_attn", "region"),
        ("model.layers.*.self_attn.q_proj", "column", "heads"),
        ("model.layers.*.self_attn.k_proj", "column", "kv_heads"),
        ("model.layers.*.self_attn.v_proj", "column", "kv_heads"),
        ("model.layers.*.self_attn.o_proj", "row", "heads"),
        ("model.layers.*.post_attention_layernorm", "sequence"),
        ("model.layers.*.mlp", "region"),
        ("model.layers.*.mlp.gate_proj", "column"),
        ("model.layers.*.mlp.up_proj", "column"),
        ("model.layers.*.mlp.down_proj", "row"),
        ("model.norm", "sequence"),
        ("lm_head", "lm_head", "vocab"),
    ),
    loss="hf_causal",
)

GPT2 = TPPlan(
    name="gpt2",
    classes=("GPT2LMHeadModel",),
    sizes={"heads": "config.num_attention_heads", "vocab": "config.vocab_size"},
    rows=(
        ("transformer.wte", "embedding", "vocab"),
        ("transformer.h.*.attn", "region"),
        ("transformer.h.*.attn.c_attn", "column", "heads", 3),  # fused q|k|v, Conv1D [in, out]
        ("transformer.h.*.attn.c_proj", "row", "heads"),
        ("transformer.h.*.mlp", "region"),
        ("transformer.h.*.mlp.c_fc", "column"),
        ("transformer.h.*.mlp.c_proj", "row"),
        ("lm_head", "lm_head", "vocab"),  # tied to wte: shares its shard
    ),
    attrs=(
        ("transformer.h.*.attn", "num_heads", "heads"),
        ("transformer.h.*.attn", "split_size", "heads"),
        ("transformer.h.*.attn", "embed_dim", "heads"),
    ),
    loss="hf_causal",
    sequence_parallel=False,  # GPT2Model reshapes ln_f's output to the full sequence
)

BERT = TPPlan(
    name="bert",
    classes=("BertModel", "BertForSequenceClassification", "BertForTokenClassification"),
    sizes={"heads": "config.num_attention_heads", "vocab": "config.vocab_size"},
    rows=(
        ("*embeddings.word_embeddings", "embedding", "vocab"),
        ("*encoder.layer.*.attention.self", "region"),
        ("*encoder.layer.*.attention.self.query", "column", "heads"),
        ("*encoder.layer.*.attention.self.key", "column", "heads"),
        ("*encoder.layer.*.attention.self.value", "column", "heads"),
        ("*encoder.layer.*.attention.output.dense", "row", "heads"),
        ("*encoder.layer.*.intermediate.dense", "column"),
        ("*encoder.layer.*.output.dense", "row"),
    ),
    attrs=(
        ("*encoder.layer.*.attention.self", "num_attention_heads", "heads"),
        ("*encoder.layer.*.attention.self", "all_head_size", "heads"),
    ),
    sequence_parallel=False,  # post-norm with position embeddings added before the scatter
)

PLANS: tuple[TPPlan, ...] = (DECODER, LLAMA, GPT2, BERT)


def plan_for(model: object) -> TPPlan | None:
    """The built-in plan whose ``classes`` name ``model``'s class, else None."""
    name = type(model).__name__
    for plan in PLANS:
        if name in plan.classes:
            return plan
    return None


__all__ = ["BERT", "DECODER", "GPT2", "LLAMA", "PLANS", "TPPlan", "plan_for"]
