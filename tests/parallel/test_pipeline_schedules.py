"""Pipeline schedules as data: every schedule, size and rank passes the validator; the
bubble computed from the action lists equals the closed form exactly (Fractions, unit op
costs); peak alive micro-batches match 1F1B's ``p - s`` and GPipe's ``m``. Pure Python."""

from __future__ import annotations

from collections import defaultdict

import pytest

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.schedules import (
    RECV_F,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    build_schedule,
    format_schedule,
)
from meshtrain.parallel.pipeline.validate import (
    InvalidSchedule,
    expected_idle_fraction,
    expected_peak_alive,
    idle_fraction,
    peak_alive,
    validate,
)

CASES = [
    (name, p, m, v)
    for p in (2, 4)
    for m in range(1, 9)
    for name, v in (
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 1),
        ("interleaved_1f1b", 2),
        ("zb_h1", 1),
        ("forward", 1),
        ("forward", 2),
    )
]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_valid_bubble_and_memory(name, p, m, v):
    s = build_schedule(name, p, m, v)
    validate(s)
    if name == "forward":
        return
    assert idle_fraction(s) == expected_idle_fraction(name, p, m, v)
    peaks = peak_alive(s)
    if name == "interleaved_1f1b" and v > 1:
        k = p if m % p == 0 else m
        by_rank = peak_alive(s, per="rank")
        for r in range(p):
            assert by_rank[r] == min(v * m, (v - 1) * k + 2 * (p - 1 - r) + 1)
    else:
        base = "1f1b" if name == "interleaved_1f1b" else name
        assert peaks == {st: expected_peak_alive(base, p, m, st) for st in range(p)}


def test_interleaved_with_one_chunk_is_1f1b():
    for p in (2, 4):
        for m in range(1, 9):
            assert build_schedule("interleaved_1f1b", p, m, 1).actions == (
                build_schedule("1f1b", p, m).actions
            )


def test_receives_are_posted_in_send_order_per_peer():
    s = build_schedule("interleaved_1f1b", 2, 4, 2)  # rank 0 gets both F and B from rank 1
    kinds = [a.kind for a in s.actions[0] if a.kind.startswith("RECV")]
    assert "RECV_F" in kinds and "RECV_B" in kinds
    validate(s)  # FIFO per (sender, receiver) checked inside


def _tamper(s: Schedule, rank: int, actions) -> Schedule:
    lists = list(s.actions)
    lists[rank] = tuple(actions)
    return Schedule(s.name, s.p, s.v, s.m, tuple(lists), s.start, s.costs)


def test_validator_catches_broken_schedules():
    s = build_schedule("1f1b", 2, 3)
    r1 = list(s.actions[1])
    # a forward before its input arrived
    i, j = r1.index(Action(1, RECV_F, 0)), r1.index(Action(1, F, 0))
    swapped = r1.copy()
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(InvalidSchedule, match="runs ahead of its input"):
        validate(_tamper(s, 1, swapped))
    # a receive without a send
    with pytest.raises(InvalidSchedule, match="missing or out of order"):
        validate(_tamper(s, 0, [a for a in s.actions[0] if a != Action(0, SEND_F, 2)]))
    # backward before forward and a missing backward
    with pytest.raises(InvalidSchedule, match="backward before its forward"):
        validate(_tamper(s, 0, [Action(0, B, 0)] + list(s.actions[0])))
    with pytest.raises(InvalidSchedule, match="missing"):
        validate(_tamper(s, 0, [a for a in s.actions[0] if a != Action(0, B, 2)]))
    # two receives swapped: FIFO order broken (each still after its send in time)
    r0 = list(s.actions[0])
    recv_b = [k for k, a in enumerate(r0) if a.kind == "RECV_B"]
    r0[recv_b[1]], r0[recv_b[2]] = r0[recv_b[2]], r0[recv_b[1]]
    with pytest.raises(InvalidSchedule):
        validate(_tamper(s, 0, r0))


def test_table_and_errors():
    table = format_schedule(build_schedule("1f1b", 4, 4))
    lines = table.splitlines()
    assert lines[0] == "1f1b: p=4 m=4 v=1" and len(lines) == 2 + 4
    assert lines[2].split()[2:6] == ["F0", "F1", "F2", "F3"]  # rank 0 warms up with p-1+1
    assert lines[5].split()[2:5] == [".", ".", "."]  # rank 3 waits p-1 steps
    assert "F0.1" in format_schedule(build_schedule("interleaved_1f1b", 2, 2, 2))
    with pytest.raises(ConfigError, match="unknown"):
        build_schedule("pipedream", 2, 2)
    with pytest.raises(ConfigError, match="virtual_stages"):
        build_schedule("1f1b", 2, 4, v=2)
    with pytest.raises(ConfigError, match="positive"):
        build_schedule("gpipe", 2, 0)


def test_one_rank_and_costs():
    s = build_schedule("interleaved_1f1b", 1, 3, 2)  # stages hand over in memory
    validate(s)
    assert not [a for a in s.actions[0] if a.kind not in (F, B)]
    # B twice as costly as F: GPipe and 1F1B keep (p-1)/(m+p-1)
    for name in ("gpipe", "1f1b"):
        s = build_schedule(name, 4, 6, costs={B: 2})
        validate(s)
        assert idle_fraction(s) == expected_idle_fraction(name, 4, 6)
    counts = defaultdict(int)
    for a in build_schedule("zb_h1", 4, 4).actions[2]:
        counts[a.kind] += 1
    assert counts["F"] == counts["B"] == counts["W"] == 4


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[0] not in ("zb_h1", "forward")])
def test_runtime_lists_reach_the_formula_when_backward_costs_two_forwards(name, p, m, v):
    """The lists the runtime executes (receives placed with ``RUN_COSTS``: B = 2 F) run
    with a backward costing two forwards (sends free, receives blocking) idle exactly the
    closed form: no receive is placed where it blocks compute that could run."""
    from meshtrain.parallel.pipeline.runtime import RUN_COSTS
    from meshtrain.parallel.pipeline.validate import executed_idle_fraction

    s = build_schedule(name, p, m, v, RUN_COSTS[False])
    validate(s)
    assert executed_idle_fraction(s, {F: 1, B: 2}) == expected_idle_fraction(name, p, m, v)


def test_unit_cost_placement_stalls_interleaved_at_real_costs():
    """Why the runtime places receives with B = 2 F: the unit-cost lists of interleaved
    1F1B at p 2, m 4, v 2 idle 1/5 instead of 1/9 when a backward costs two forwards."""
    from fractions import Fraction

    from meshtrain.parallel.pipeline.validate import executed_idle_fraction

    unit = build_schedule("interleaved_1f1b", 2, 4, 2)
    assert executed_idle_fraction(unit, {F: 1, B: 1}) == Fraction(1, 9)
    assert executed_idle_fraction(unit, {F: 1, B: 2}) == Fraction(1, 5)
