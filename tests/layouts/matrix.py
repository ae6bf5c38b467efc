"""The layout matrix: every combination of pp, dp (ZeRO 0-3), tp (with and without
sequence parallelism), cp and ep that fits on 8 ranks with sizes 1, 2, 4, for three models,
and what meshtrain does with each: train it, or refuse it by name.

The expected outcome is never written here by hand: it is what ``plan.validity.LayoutCheck``
says, which runs the engine's own checks (``load_config``, the mesh arithmetic,
``parallelize``'s refusals) on the meta-device model. So when a refusal is lifted in the
engine the table follows, and a layout that starts to train joins the trained set; the
only list kept here is ``SAMPLED``, the trained layouts the default suite runs (the whole
trained set runs as the longer job, ``test_matrix.py``).

``docs/layouts.md`` is :func:`render`'s output (``python tools/layouts_table.py`` writes it;
a test compares it with the committed file).

The models (tiny, random weights; every head and expert count divisible by 4, 4 blocks, so
no combination is refused for a size that only these tiny models have):

* ``decoder``: meshtrain's reference Decoder (4 tied blocks, width 32, 4 heads);
* ``llama``: transformers ``LlamaForCausalLM`` (4 layers, 4 heads and 4 kv heads);
* ``mixtral``: transformers ``MixtralForCausalLM`` (4 layers, 8 experts top-2, router
  auxiliary loss 0.02 with ``output_router_logits``).

The training data: each step ``MICRO`` micro-batches of ``ROWS`` rows x ``SEQ`` tokens
over all replicas; replica ``r`` of ``dp`` takes rows ``[r ROWS/dp, (r+1) ROWS/dp)`` (cp and
tp ranks share their replica's rows).
"""

from __future__ import annotations

import itertools
from collections import Counter

from tests.layouts.refusals import REFUSALS

SIZES = (1, 2, 4)
WORLD = 8  # the most ranks a layout may use
STAGES = (0, 1, 2, 3)
SEQ = 16  # a multiple of 2 cp (cp's chunks) and of tp (sequence parallelism)
ROWS = 4  # rows per micro-batch over all replicas (dp <= 4 divides it)
MICRO = 2  # micro-batches per step (= gradient_accumulation_steps)
VOCAB = 64
MODELS = ("decoder", "llama", "mixtral")
# Per model, the trained layouts the default suite runs (labels of ``label``): one 4-rank
# group, each dimension split at least once, each ZeRO stage once (README's time budget).
SAMPLED = {
    "decoder": ("pp2 dp2 z1", "tp2sp cp2", "dp4 z3"),
    "llama": ("pp2 tp2sp", "dp2 z2 cp2"),
    "mixtral": ("dp2 z1 tp2 ep2", "pp2 dp2 ep2"),
}


def layouts() -> list:
    """Every combination (module docstring), as ``plan.layout.Layout``: sizes 1, 2, 4 with
    ``pp dp tp cp <= WORLD``, ep dividing ``dp cp`` (ep is carved out of dp x cp), each ZeRO
    stage, sequence parallelism on and off where tp > 1."""
    from meshtrain.plan.layout import Layout

    out = []
    for pp, dp, tp, cp, ep in itertools.product(SIZES, repeat=5):
        if pp * dp * tp * cp > WORLD or (dp * cp) % ep:
            continue
        for stage in STAGES:
            for sp in (False, True) if tp > 1 else (False,):
                out.append(
                    Layout(
                        pp=pp,
                        dp=dp,
                        tp=tp,
                        cp=cp,
                        ep=ep,
                        stage=stage,
                        sequence_parallel=sp,
                        micro_batch=ROWS // dp,
                        grad_accum=MICRO,
                    )  # fmt: skip
                )
    return out


def label(layout) -> str:
    """A short name: the dimensions that are split (and the ZeRO stage when not 0)."""
    parts = []
    if layout.pp > 1:
        parts.append(f"pp{layout.pp}")
    if layout.dp > 1:
        parts.append(f"dp{layout.dp}")
    if layout.stage:
        parts.append(f"z{layout.stage}")
    if layout.tp > 1:
        parts.append(f"tp{layout.tp}" + ("sp" if layout.sequence_parallel else ""))
    if layout.cp > 1:
        parts.append(f"cp{layout.cp}")
    if layout.ep > 1:
        parts.append(f"ep{layout.ep}")
    return " ".join(parts) or "one process"


def build(name: str, seed: int = 0):
    """The model ``name`` (module docstring), fp32, seeded weights."""
    import torch

    from tests.tiny_models import tiny_decoder, tiny_llama

    torch.manual_seed(seed)
    if name == "decoder":
        return tiny_decoder(n_heads=4, max_seq_len=SEQ)
    if name == "llama":
        return tiny_llama(seed, num_hidden_layers=4, num_key_value_heads=4)
    if name == "mixtral":
        from tests.distributed.test_moe import tiny_causal_lm

        return tiny_causal_lm(
            "mixtral", seed, num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=4,
        )  # fmt: skip
    raise ValueError(f"unknown matrix model {name!r}; one of {MODELS}")


def table(name: str) -> list[tuple]:
    """``[(layout, refusal or None)]`` for model ``name``: the engine's checks on the
    meta-device model (``LayoutCheck``), in ``layouts()`` order."""
    import torch

    from meshtrain.plan.model_facts import ModelFacts
    from meshtrain.plan.validity import LayoutCheck

    with torch.device("meta"):
        model = build(name)
    check = LayoutCheck(ModelFacts.of(model), SEQ, precision="fp32")
    return [(layout, check.refusal(layout)) for layout in layouts()]


def trained(rows: list[tuple]) -> list:
    """The layouts of a ``table`` that train."""
    return [layout for layout, why in rows if why is None]


def counts(rows: list[tuple]) -> tuple[int, Counter]:
    """(how many train, refusals per reason) of a ``table``."""
    why = Counter(r for _, r in rows if r is not None)
    return sum(1 for _, r in rows if r is None), why


def render(tables: dict[str, list[tuple]] | None = None) -> str:
    """docs/layouts.md (module docstring): counts, every refused combination under its
    reason, and the trained ones (the default suite's sample marked)."""
    tables = tables if tables is not None else {name: table(name) for name in MODELS}
    lines = [
        "# Layouts: what trains and what is refused",
        "",
        "<!-- generated by `python tools/layouts_table.py` from tests/layouts/matrix.py; "
        "tests/layouts/test_matrix.py fails when this file differs -->",
        "",
        "Every combination of pipeline (pp), data (dp, with ZeRO stage 0-3), tensor (tp, "
        "with and without sequence parallelism, `sp`), context (cp) and expert (ep, carved "
        "out of dp x cp) parallelism that fits on 8 ranks with sizes 1, 2 and 4, for "
        "meshtrain's reference Decoder, a transformers Llama (dense) and a transformers "
        "Mixtral (mixture of experts). Each either trains like one process (fp32 AdamW "
        "steps, losses and the whole model within `tests/tolerance.py`'s trajectory bound) "
        "or is refused by `meshtrain.initialize` before it changes the model, with the "
        "`ConfigError` quoted below (its first line). The table is computed from the "
        "engine's own checks (`meshtrain.plan.validity.LayoutCheck` on the meta-device "
        "model), so it is also what `meshtrain plan` proposes from.",
        "",
        "Labels name the split dimensions only: `pp2 dp2 z1 tp2sp` is pp 2 x dp 2 at ZeRO 1 "
        "x tp 2 with sequence parallelism, cp 1, ep 1; `one process` is all sizes 1.",
        "",
        "How the rows are checked (`tests/layouts/test_matrix.py`): every refusal is "
        "asserted to be a `ConfigError` naming a config key; one layout per distinct reason "
        "is initialized on real ranks and must raise the same line; the trained layouts "
        "marked `*` run in the default suite (one 4-rank group) and every trained layout "
        "runs in the longer job (`MESHTRAIN_LONG_JOBS=1 pytest tests/layouts`).",
        "",
        "## Counts",
        "",
        "| model | combinations | train | refused |",
        "|---|---:|---:|---:|",
    ]
    for name, rows in tables.items():
        n_train, why = counts(rows)
        lines.append(f"| {name} | {len(rows)} | {n_train} | {sum(why.values())} |")
    for name, rows in tables.items():
        n_train, why = counts(rows)
        lines += ["", f"## {name}", "", f"### Refused ({sum(why.values())})", ""]
        for reason, n in sorted(why.items(), key=lambda kv: (-kv[1], kv[0])):
            which = [label(lay) for lay, r in rows if r == reason]
            lines += [f"- **{n}** x `{reason}`", "", "  " + ", ".join(which), ""]
        sampled = set(SAMPLED.get(name, ()))
        names = [label(lay) + ("*" if label(lay) in sampled else "") for lay in trained(rows)]
        lines += [f"### Trains ({n_train})", "", ", ".join(names)]
    lines += [
        "",
        "## Refused outside the matrix",
        "",
        "Pipeline forms and schedules crossed with the other dimensions, each initialized "
        "on real ranks by `tests/layouts/test_refusals.py` (`tests/layouts/refusals.py`), "
        "which asserts the line it starts with:",
        "",
    ]
    lines += [f"- {row.what}: `{row.line} ...`" for row in REFUSALS]
    return "\n".join(lines) + "\n"


__all__ = ["MODELS", "SAMPLED", "build", "counts", "label", "layouts", "render", "table"]
