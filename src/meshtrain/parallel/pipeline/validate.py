"""Checks that a schedule's action lists are complete, causal, matched and deadlock-free.

``validate(schedule)`` raises ``InvalidSchedule`` naming the rank and action when:

* a compute action is missing, repeated, or on the wrong rank (stage ``s`` is on rank
  ``schedule.rank_of(s)``: ``s % p``, or the V of zbv / dualpipev); a training schedule runs ``F`` then ``B`` (then ``W``) of every micro-batch
  on every stage, a forward-only one only ``F``;
* a stage runs ahead of its input: ``F(s, i)`` before the activation of ``(s - 1, i)`` is
  received (or computed, on the same rank), ``B(s, i)`` before the gradient of ``(s + 1,
  i)``; a backward before its forward, a ``W`` before its ``B``; a send before the compute
  that produces it;
* a send has no receive or a receive no send, or the receives from one peer come in a
  different order than that peer's sends (FIFO p2p matching would pair the wrong tensors);
* executing the lists with non-blocking sends and blocking receives gets stuck.

``idle_fraction`` measures the bubble from the simulated timeline of a schedule,
``executed_idle_fraction`` from running its lists with other op costs, and
``expected_idle_fraction`` is the closed form of ``schedules``' docstring; all are exact
``Fraction``s. ``peak_alive`` counts micro-batches alive per stage.
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.schedules import (
    COMPUTE,
    FORWARD_ONLY,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SPLIT_BACKWARD,
    Action,
    B,
    F,
    Schedule,
    W,
    frees_activations,
)


class InvalidSchedule(ConfigError):
    """A schedule's action lists break one of the rules in ``validate``'s module docstring."""


def _kinds(schedule: Schedule) -> tuple[str, ...]:
    if schedule.name in FORWARD_ONLY:
        return (F,)
    return (F, B, W) if schedule.name in SPLIT_BACKWARD else (F, B)


def validate(schedule: Schedule) -> None:
    """Raise ``InvalidSchedule`` unless ``schedule`` obeys every rule (module docstring)."""
    p, last = schedule.p, schedule.num_stages - 1
    kinds = _kinds(schedule)
    seen: dict[Action, int] = {}
    sends: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> messages
    recvs: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for rank, actions in enumerate(schedule.actions):
        done: set[Action] = set()
        for pos, a in enumerate(actions):

            def fail(why: str, rank=rank, pos=pos, a=a) -> InvalidSchedule:
                return InvalidSchedule(
                    f"{schedule.name} p={p} m={schedule.m}: rank {rank} action {pos} {a}: {why}"
                )

            if schedule.rank_of(a.stage) != rank:
                raise fail(f"stage {a.stage} belongs to rank {schedule.rank_of(a.stage)}")
            if a in done:
                raise fail("repeated")
            s, i = a.stage, a.mb
            if a.kind in COMPUTE:
                if a.kind not in kinds:
                    raise fail(f"{schedule.name} has no {a.kind} actions")
                seen[a] = rank
            if a.kind == F and s > 0:
                local = schedule.rank_of(s - 1) == rank
                need = Action(s - 1, F, i) if local else Action(s, RECV_F, i)
                if need not in done:
                    raise fail(f"runs ahead of its input ({need} has not happened)")
            if a.kind == B:
                if Action(s, F, i) not in done:
                    raise fail("backward before its forward")
                if s < last:
                    local = schedule.rank_of(s + 1) == rank
                    need = Action(s + 1, B, i) if local else Action(s, RECV_B, i)
                    if need not in done:
                        raise fail(f"runs ahead of its output gradient ({need} has not happened)")
            if a.kind == W and Action(s, B, i) not in done:
                raise fail("weight gradient before the input gradient")
            if a.kind in (SEND_F, SEND_B):
                produced = Action(s, F if a.kind == SEND_F else B, i)
                if produced not in done:
                    raise fail(f"sends before {produced}")
                dst_stage = s + 1 if a.kind == SEND_F else s - 1
                if not 0 <= dst_stage <= last or schedule.rank_of(dst_stage) == rank:
                    raise fail(f"no peer rank for stage {dst_stage}")
                sends[(rank, schedule.rank_of(dst_stage))].append((a.kind, s, i))
            if a.kind in (RECV_F, RECV_B):
                src_stage = s - 1 if a.kind == RECV_F else s + 1
                if not 0 <= src_stage <= last or schedule.rank_of(src_stage) == rank:
                    raise fail(f"no peer rank for stage {src_stage}")
                send_kind = SEND_F if a.kind == RECV_F else SEND_B
                recvs[(schedule.rank_of(src_stage), rank)].append((send_kind, src_stage, i))
            done.add(a)
    expected = {
        Action(s, k, i)
        for s in range(schedule.num_stages)
        for k in kinds
        for i in range(schedule.m)
    }
    if set(seen) != expected:
        missing = sorted(expected - set(seen))[:4]
        raise InvalidSchedule(f"{schedule.name}: compute actions missing: {missing}")
    for pair in set(sends) | set(recvs):
        if sends.get(pair, []) != recvs.get(pair, []):
            raise InvalidSchedule(
                f"{schedule.name}: rank {pair[0]} -> {pair[1]} sends {sends.get(pair, [])} but "
                f"the receiver posts {recvs.get(pair, [])} (missing or out of order)"
            )
    _check_runs(schedule)


def _check_runs(schedule: Schedule) -> None:
    """Execute the lists: sends complete at once, a receive waits for its send."""
    pos = [0] * schedule.p
    sent: set[tuple] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                if a.kind == RECV_F and (SEND_F, a.stage - 1, a.mb) not in sent:
                    break
                if a.kind == RECV_B and (SEND_B, a.stage + 1, a.mb) not in sent:
                    break
                if a.kind in (SEND_F, SEND_B):
                    sent.add((a.kind, a.stage, a.mb))
                pos[rank] += 1
                progressed = True
    stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(schedule.actions) if pos[r] < len(acts)}
    if stuck:
        raise InvalidSchedule(f"{schedule.name}: deadlock, ranks wait at {stuck}")


def idle_fraction(schedule: Schedule) -> Fraction:
    """Idle rank-time over total rank-time of the simulated step (the bubble)."""
    total = schedule.p * schedule.makespan
    busy = sum(schedule.costs[a.kind] for a in schedule.start)
    return Fraction(total - busy, total)


def executed_idle_fraction(schedule: Schedule, costs: dict[str, int]) -> Fraction:
    """The bubble when the action lists *run* with op costs ``costs`` (sends free, a
    receive blocking until its send): what a rank really idles when the costs differ from
    those the receives were placed by, since a receive placed too early blocks compute."""
    pos, now, busy = [0] * schedule.p, [0] * schedule.p, [0] * schedule.p
    sent: dict[tuple, int] = {}
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                if a.kind in (RECV_F, RECV_B):
                    key = (
                        (SEND_F, a.stage - 1, a.mb)
                        if a.kind == RECV_F
                        else (SEND_B, a.stage + 1, a.mb)
                    )
                    if key not in sent:
                        break
                    now[rank] = max(now[rank], sent[key])
                elif a.kind in (SEND_F, SEND_B):
                    sent[(a.kind, a.stage, a.mb)] = now[rank]
                else:
                    now[rank] += costs[a.kind]
                    busy[rank] += costs[a.kind]
                pos[rank] += 1
                progressed = True
    _check_runs(schedule)  # raises if the loop above got stuck
    total = schedule.p * max(now)
    return Fraction(total - sum(busy), total)


def expected_idle_fraction(name: str, p: int, m: int, v: int = 1) -> Fraction:
    """The closed-form bubble of ``schedules``' docstring (unit op costs)."""
    if name in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if name == "interleaved_1f1b":
        if m >= p:
            return Fraction(p - 1, v * m + p - 1)
        return Fraction(v * (p - m) + m - 1, v * p + m - 1)
    if name == "zb_h1":
        if m >= p:
            return Fraction(p - 1, 3 * m + p - 1)
        return Fraction(2 * p - m - 1, 2 * p + 2 * m - 1)
    if name in ("zbv", "dualpipev"):
        # 6 m unit ops per rank (F, B, W of two chunks); the step lasts the longer of the
        # filled pipeline's 6 m + p - 1 and the unfilled one's 4 (p + m) - 2 (zbv with
        # m < 3p/2: micro-batch 0 walks the V down and up before the W's catch up)
        makespan = max(6 * m + p - 1, 4 * (p + m) - 2)
        return Fraction(makespan - 6 * m, makespan)
    raise ConfigError(f"no bubble formula for schedule {name!r}")


def peak_alive(schedule: Schedule, per: str = "stage") -> dict[int, int]:
    """The most micro-batches with forward done and backward (``W`` for ZB-H1) not yet
    done, over the action lists: by stage (``per="stage"``) or, adding a rank's stages at
    each moment, by rank (``per="rank"``)."""
    free_kind = frees_activations(schedule.name)
    peak: dict[int, int] = defaultdict(int)
    for rank, actions in enumerate(schedule.actions):
        alive: dict[int, int] = defaultdict(int)
        for a in actions:
            if a.kind == F:
                alive[a.stage] += 1
            elif a.kind == free_kind:
                alive[a.stage] -= 1
            else:
                continue
            if per == "rank":
                peak[rank] = max(peak[rank], sum(alive.values()))
            else:
                peak[a.stage] = max(peak[a.stage], alive[a.stage])
    return dict(peak)


def expected_peak_alive(name: str, p: int, m: int, stage: int) -> int:
    """GPipe ``m``; 1F1B ``min(m, p - s)``; ZB-H1 ``min(m, p)`` (schedules' docstring).
    For zbv / dualpipev ``stage`` is the rank and the count is in chunk activations over
    its two stages (``peak_alive(per="rank")``): zbv ``min(2 m, 2 p, m + 1 + r)``,
    dualpipev ``2 p + 1``; a chunk holds half a 1F1B stage's layers."""
    if name == "zbv":
        return min(2 * m, 2 * p, m + 1 + stage)
    if name == "dualpipev":
        return 2 * p + 1
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(m, p - stage)
    if name == "zb_h1":
        return min(m, p)
    raise ConfigError(f"no closed-form peak for schedule {name!r}")
