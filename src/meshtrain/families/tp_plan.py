"""``TPPlan``: a tensor-parallel plan, a table mapping module paths to styles.

Each model family's room (``meshtrain.families.<family>``) declares its plans;
``parallel.tensor.plans.plan_for`` picks one by the model's class and
``parallel.tensor.apply`` carries it out. The record lives here, below ``parallel/``, so a
room (and ``config``, which parses a user's plan at load) can build one without importing
the mechanism.

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

from meshtrain.errors import ConfigError

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


__all__ = ["STYLES", "Row", "TPPlan"]
