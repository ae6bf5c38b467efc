"""The layout matrix (``matrix.py``): every combination of pp, dp/ZeRO, tp/SP, cp and ep on
up to 8 ranks, for the Decoder, Llama and Mixtral, trains like one process or is refused
by name before the model changes.

* Refusals: every one is a ``ConfigError`` whose first line starts with the config key
  of the dimension it refuses (``mesh.<dim>_parallel_size``, ``zero_optimization.stage``,
  ``tensor_parallel.sequence_parallel``, ...) and says what to set; for each distinct
  reason, one of its layouts is initialized on real ranks and must raise the same line
  (so the table, computed on the meta-device model by ``LayoutCheck``, is the engine's).
* Training: 3 fp32 AdamW steps of each trained layout against one process in plain
  PyTorch (``ranks.reference``): the first step's loss within ``evaluation()`` (1.9e-6:
  one evaluation from identical weights), per-step losses (relative) and the whole model
  (normwise) within ``trajectory(lr, 3)`` (``tests/tolerance.py``; lr 1e-3 for the
  Decoder: 3.6e-6, 1e-2 for Llama and Mixtral: 1.9e-5). The two sides differ only in the
  order of fp32 sums (tp partial sums, dp averages, cp's attention merge, the experts'
  all-to-all regrouping, ZeRO's reduce-scatter), the rule's row 3. The default suite
  trains ``SAMPLED`` (one 4-rank group, each dimension and ZeRO stage at least once);
  ``MESHTRAIN_LONG_JOBS=1`` trains every layout the table says trains, one group per
  (world size, model).
* docs/layouts.md is ``render()``'s output, byte for byte.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.harness import run_ranks
from tests.layouts.matrix import MODELS, SAMPLED, label, render, table, trained
from tests.layouts.ranks import group, lr
from tests.tolerance import check, check_trajectory, evaluation, trajectory

STEPS = 3
DOC = Path(__file__).resolve().parents[2] / "docs" / "layouts.md"
LONG = os.environ.get("MESHTRAIN_LONG_JOBS") == "1"
# a refusal's first line: the config key it refuses, then what is wrong with its value
KEY = re.compile(r"^(mesh\.[a-z_]+|zero_optimization\.stage|tensor_parallel\.[a-z_]+|"
                 r"context_parallel\.[a-z_]+|pipeline\.[a-z_]+|loss\.[a-z_]+|--seq)[:= ]")  # fmt: skip


@pytest.fixture(scope="module")
def tables() -> dict:
    return {name: table(name) for name in MODELS}


def _one_per_reason(rows: list[tuple], world: int | None) -> list:
    """For each distinct refusal, its first layout (at ``world`` ranks when given)."""
    picked: dict[str, object] = {}
    for layout, why in rows:
        if why is not None and why not in picked and world in (None, layout.world):
            picked[why] = layout
    return list(picked.values())


def check_group(jobs: list[tuple], rows_by_model: dict, steps: int = STEPS) -> None:
    """Run ``jobs`` (``ranks.group``'s) on one group and check each result (module
    docstring): a refusal's line is the table's, a trained layout within
    ``trajectory(lr, steps)`` of one process."""
    world = jobs[0][2].world
    results, refs = run_ranks(group, world, jobs, steps, timeout=1800)[0]
    why = {(name, label(lay)): r for name, rows in rows_by_model.items() for lay, r in rows}
    for (kind, name, layout, *_), result in zip(jobs, results, strict=True):
        what = f"{name} {label(layout)}"
        if kind == "refuse":
            assert result == why[(name, label(layout))], (what, result)
            continue
        losses, state = result
        ref_losses, ref_state = refs[name]
        missing = sorted(set(ref_state) - set(state))
        assert not missing, (what, missing)
        state = {k: state[k] for k in ref_state}
        # the first step's loss is one evaluation from identical weights (row 2)
        check(
            f"{what}: loss at step 0", abs(losses[0] - ref_losses[0]) / ref_losses[0], evaluation()
        )
        bound = trajectory(lr(name), steps)
        check_trajectory(what, (losses, state), (ref_losses, ref_state), bound)


def test_every_refusal_names_its_key_and_a_fix(tables):
    """Every refused combination's line names the config key and what to do."""
    for name, rows in tables.items():
        for layout, why in rows:
            if why is None:
                continue
            assert KEY.match(why), (name, label(layout), why)
            assert re.search(r"\b(set|use|pick|split|give)\b", why), (name, label(layout), why)
        assert trained(rows), name  # each model trains somewhere beyond one process
        assert len(trained(rows)) > 1, name


def test_docs_are_the_table(tables):
    """docs/layouts.md is generated from the table (``python tools/layouts_table.py``)."""
    assert DOC.read_text(encoding="utf-8") == render(tables), (
        "docs/layouts.md is stale: run `python tools/layouts_table.py`"
    )


def test_sampled_layouts_train_and_refusals_raise(tables):
    """The default suite's share (one 4-rank group): ``SAMPLED``'s layouts train like one
    process, and one 4-rank layout of each reason raises its line from ``initialize``."""
    jobs = []
    for name in MODELS:
        by_label = {label(lay): (lay, why) for lay, why in tables[name]}
        for lab in SAMPLED[name]:
            layout, why = by_label[lab]
            assert why is None, f"SAMPLED {name} {lab} is refused: {why}; pick a trained one"
            jobs.append(("train", name, layout))
    jobs += [("refuse", "mixtral", lay) for lay in _one_per_reason(tables["mixtral"], 4)]
    jobs += [("refuse", "decoder", lay) for lay in _one_per_reason(tables["decoder"], 4)]
    assert {lay.world for _, _, lay in jobs} == {4}
    check_group(jobs, tables)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # Mixtral at 8 ranks: 167 layouts in one group, ~7 min quiet
@pytest.mark.skipif(not LONG, reason="longer job: set MESHTRAIN_LONG_JOBS=1 (tests/layouts)")
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("name", MODELS)
def test_full_matrix(tables, name, world):
    """Every trained layout of ``name`` at ``world`` ranks, and every refusal reason that
    has a layout at this size, on one group."""
    rows = tables[name]
    jobs = [("train", name, lay) for lay in trained(rows) if lay.world == world]
    jobs += [("refuse", name, lay) for lay in _one_per_reason(rows, world)]
    if not jobs:
        pytest.skip(f"{name}: no layout at {world} ranks")
    check_group(jobs, {name: rows})
