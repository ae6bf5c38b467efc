"""Host RAM per rank while a layout loads (``plan.host_memory``): the phases' arithmetic
exactly, and a small version of docs/plan.md's load table run for real.

Tolerance of the measured rows: within 15%, the issue's bound (docs/plan.md's 14 rows are
within 7.3%, all under: glibc's heap of blocks below the mmap threshold, about 20 MB a rank,
is not predicted). The measure is the RSS high-water mark from before the model is built to
after ``initialize``, with every block of 64 KiB or more mmapped (``plan.measure``): bytes
alive, not a time, so the machine's load does not move it. The models are large enough
(140-240 MB of fp32 parameters; at these sizes the wrap decides both rows) that tensors, not the interpreter, decide the peak.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshtrain.plan.host_memory import (
    DYNAMO_IMPORT,
    INITIALIZE_IMPORT,
    TRANSFORMERS_IMPORT,
    build_transient,
)
from meshtrain.plan.layout import Layout
from meshtrain.plan.proof import BIG_DECODER, BIG_LLAMA, BIG_MIXTRAL, DECODER, SEQ

DEC = dict(DECODER, dim=768, n_layers=6)  # ~120 MB of fp32 parameters


def _planner(cfg, world, **options):
    from meshtrain.plan.calibrate import planner_for
    from meshtrain.plan.hardware import Hardware

    return planner_for(cfg, replace(Hardware.cpu(), overhead_bytes=0), world, SEQ, 8, **options)


def test_phases_follow_the_formula_exactly():
    planner = _planner(DEC, 2)
    facts = planner.facts
    whole = 4 * facts.params
    assert build_transient(facts) == 2 * 4 * facts.largest  # randn(shape) * std
    dp1 = planner.predict(Layout(dp=2, stage=1, micro_batch=2)).host
    assert dp1.build == whole + build_transient(facts)
    assert dp1.wrap == 2 * whole  # the whole model beside its flat copy
    assert dp1.settled == whole + DYNAMO_IMPORT + INITIALIZE_IMPORT
    # 120 MB: the code initialize loads (178 MB) outweighs the second copy
    assert dp1.phase == "settled" and dp1.peak == dp1.settled
    assert dp1.per_node == 2 * dp1.peak
    z3 = planner.predict(Layout(dp=2, stage=3, micro_batch=2))
    assert z3.host.wrap == whole + z3.memory.states.params  # the partition, persistent ones whole
    tp = planner.predict(Layout(dp=1, tp=2, micro_batch=2))
    assert tp.host.wrap == 2 * tp.memory.states.params  # the tp shard kept and its flat copy


def test_a_transformers_family_carries_its_import_and_ep_its_cut():
    from meshtrain.plan.proof import BIG_MIXTRAL

    planner = _planner(BIG_MIXTRAL, 2)
    facts = planner.facts
    whole, code = 4 * facts.params, DYNAMO_IMPORT + TRANSFORMERS_IMPORT
    host = planner.predict(Layout(dp=2, ep=2, stage=1, micro_batch=2)).host
    assert host.build == whole + code  # transformers initialises in place
    assert host.wrap == whole + 4 * facts.expert_params // 2 + code  # the ep cut


@pytest.mark.parametrize(
    ("cfg", "layout"),
    [(BIG_DECODER, Layout(dp=2, stage=3, micro_batch=2)), (BIG_LLAMA, Layout(dp=1, micro_batch=2))],
    ids=["decoder-dp2-z3", "llama-dp1"],
)
def test_load_peak_predicted_against_measured(cfg, layout):
    from meshtrain.plan.measure import measure

    predicted = _planner(cfg, layout.world).predict(layout).host.peak
    measured = measure(cfg, layout, seq=SEQ, steps=0, timeout=300)["load_peak"]
    assert abs(predicted / measured - 1) < 0.15, (predicted, measured)


def test_sliced_loading_holds_no_whole_model():
    """``meshtrain.from_pretrained(folder, config=...)``: the build is the code alone, and
    the wrap is the rank's flat storage (its 1/ep of the experts, the dense part whole at
    ZeRO-1) plus the code; nothing of the whole model. A meshtrain Decoder is not loaded
    this way: refused by name."""
    from meshtrain.errors import ConfigError

    planner = _planner(BIG_MIXTRAL, 2, loading="sliced")
    facts = planner.facts
    code = DYNAMO_IMPORT + TRANSFORMERS_IMPORT
    host = planner.predict(Layout(dp=2, ep=2, stage=1, micro_batch=2)).host
    flat = 4 * (facts.params - facts.expert_params + facts.expert_params // 2)
    assert host.build == code
    assert host.wrap == flat + code
    assert host.settled == flat + code + INITIALIZE_IMPORT
    with pytest.raises(ConfigError, match="^--loading sliced: only transformers models"):
        _planner(BIG_DECODER, 1, loading="sliced")


def test_sliced_load_peak_predicted_against_measured():
    """A Mixtral at ep 2 loaded sliced: before the expert cut made its shards as
    uninitialised tensors (``meshtrain_values_follow``), each rank held its expert slice
    twice for a moment (measured -17.9% against this prediction, now +1.1%)."""
    from meshtrain.plan.measure import measure

    layout = Layout(dp=2, ep=2, stage=1, micro_batch=2)
    predicted = _planner(BIG_MIXTRAL, 2, loading="sliced").predict(layout).host.peak
    measured = measure(BIG_MIXTRAL, layout, seq=SEQ, steps=0, timeout=300, loading="sliced")
    assert abs(predicted / measured["load_peak"] - 1) < 0.15, (predicted, measured)


def test_zero_init_builds_partitions_and_one_parameter_whole():
    """Under ``meshtrain.zero.Init`` the Decoder's build holds its partitions and one
    parameter whole with its temporaries; only ZeRO-3 is planned that way (refused by
    name otherwise)."""
    planner = _planner(BIG_DECODER, 2, loading="zero-init")
    layout = Layout(dp=2, stage=3, micro_batch=2)
    host = planner.predict(layout).host
    flat = host.settled - DYNAMO_IMPORT - INITIALIZE_IMPORT
    assert host.build == flat + 4 * 4 * planner.facts.largest
    assert host.wrap == flat + 0  # the decoder carries no transformers import
    why = planner.refusal(layout.but(stage=2))
    assert why.startswith("zero_optimization.stage 2 with --loading zero-init")
