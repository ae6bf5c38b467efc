"""Pipeline schedules as data: one list of actions per rank, computed before the step.

A model cut into ``S = p * v`` stages runs on ``p`` ranks; stage ``s`` lives on rank
``s % p`` (``v`` virtual stages per rank, looped placement as in Megatron-LM), except
under the V-shaped schedules (zbv, dualpipev: ``v = 2``), where rank ``r`` holds stages
``r`` and ``2 p - 1 - r`` (``stage_rank``): the activations walk down the ranks and back
up, the last stage sits beside the first on rank 0, and stages ``p - 1`` and ``p`` hand
over in memory on rank ``p - 1``. A step
runs ``m`` micro-batches. Each rank executes its own list of ``Action(stage, kind, mb)``:

* ``F`` forward, ``B`` backward (with ``W`` split out: ``B`` is the input gradient only
  and ``W`` the weight gradient, for zero-bubble schedules);
* ``SEND_F``/``RECV_F`` the activation from stage ``s`` to ``s + 1`` (``SEND_F`` carries
  the sending stage, ``RECV_F`` the receiving one), ``SEND_B``/``RECV_B`` the gradient
  from stage ``s`` to ``s - 1`` (again sender's / receiver's stage). Neighbouring stages
  on one rank (only when ``p == 1``) hand over in memory, without actions.

How the lists are made: a rule gives each rank the *order* of its compute actions; a
simulation with per-kind costs (unit costs by default) starts every action as soon as its
rank is free and its input has arrived, which gives each action a start time. Sends are
placed right after the compute that produced them; a receive is placed before the first
compute of its rank that starts at or after the data's arrival. So every rank posts its
receives in the global order of the sends (per peer, first sent = first received, which
is what FIFO p2p matching needs: torch fixed its interleaved hangs the same way), and a
rank that blocks on a receive only ever waits for something sent earlier in simulated
time: the wait-for graph is acyclic and the step cannot deadlock whatever the real costs.

Bubble (idle fraction, ``t_F``/``t_B`` the forward/backward time of one micro-batch on a
full stage; unit op costs make it exact, ``validate.idle_fraction`` checks that):

* GPipe (all forwards, then all backwards) and 1F1B: every rank idles ``(p - 1)(t_F +
  t_B)`` of ``(m + p - 1)(t_F + t_B)``, so the bubble is ``(p - 1) / (m + p - 1)``.
* Interleaved 1F1B (``v`` chunks of ``1/v`` the cost each): the fill and drain shrink to
  ``(p - 1)(t_F + t_B) / v``, so the bubble is ``(p - 1) / (v m + p - 1)`` for ``m >= p``
  (micro-batches go through in rounds of ``p``, or one round of all ``m`` when ``p`` does
  not divide ``m``). With ``m < p`` the pipeline never fills: a chunk's micro-batch 0
  must travel all ``p`` ranks before the next chunk starts, the step lasts
  ``2 (v p + m - 1)`` unit ops and the bubble is ``(v (p - m) + m - 1) / (v p + m - 1)``.
* ZB-H1 (backward split into input gradient ``B`` and weight gradient ``W``, rank ``r``
  holds back its first ``r`` ``W``'s to run them in the drain; unit costs ``t_F = t_B =
  t_W``): the bubble is ``(p - 1)(t_F + t_B - t_W)`` of ``3 m`` units of work, i.e.
  ``(p - 1) / (3 m + p - 1)`` for ``m >= p``; with ``m < p`` the step lasts
  ``2 p + 2 m - 1`` and the bubble is ``(2 p - m - 1) / (2 p + 2 m - 1)``.
* ZBV (torch's ``ScheduleZBVZeroBubble``, Qi et al. 2024 section 6) and DualPipeV
  (torch's ``ScheduleDualPipeV``, DeepSeek's DualPipe folded into a V; it needs
  ``m >= 2 p``): two chunks per rank, each ``F``, ``B`` and ``W`` one unit, so ``6 m``
  units of work per rank. The step lasts ``6 m + p - 1`` once the pipeline fills (the
  ``p - 1`` units of the first forward's walk down the V that no ``W`` can cover) and
  ``4 (p + m) - 2`` before it does (zbv with ``m < 3p/2``), so the bubble is
  ``(T - 6 m) / T`` with ``T = max(6 m + p - 1, 4 (p + m) - 2)``: ``(p - 1) / (6 m + p
  - 1)`` filled, half interleaved 1F1B's at ``v = 2`` (where ``B`` costs ``2 F`` the fill
  is ``(p - 1)(t_F + t_B) / 2``; here ``W`` fills it).

Peak micro-batches whose activations are alive on stage ``s`` (forward done, backward
-- ``W`` for ZB-H1 -- not yet finished): GPipe ``m``; 1F1B ``min(m, p - s)`` (stage 0
holds the most); ZB-H1 ``min(m, p)`` on every stage (the held-back ``W``'s keep inputs
alive: the same peak as 1F1B's stage 0); interleaved: at most ``(v - 1) k + 2 (p - 1 - r)
+ 1`` chunk activations on rank ``r`` (``k`` micro-batches per round) over its ``v``
stages. Per rank, in chunk activations (a chunk is half a 1F1B stage): zbv ``min(2 m, 2 p,
m + 1 + r)``, never more than 1F1B's stage-0 peak (``min(m, p)`` stages' worth) and
equal to it on every rank once ``m >= 2 p - 1``; dualpipev ``2 p + 1``, half a stage more than 1F1B's stage 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.actions import (  # noqa: F401  (re-exported)
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
)
from meshtrain.parallel.pipeline.v_shape import (
    V_SHAPED,
    order_dualpipev,
    order_zbv,
    rank_stages,
    stage_rank,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "forward")
FORWARD_ONLY = ("forward", "forward_v")  # evaluation's schedules, looped and V-shaped
# backward split into B (input gradient) and W (weight gradients): W frees a micro-batch
SPLIT_BACKWARD = ("zb_h1", "zbv", "dualpipev")


def frees_activations(name: str) -> str:
    """The compute kind after which a micro-batch's activations on a stage are dropped."""
    return W if name in SPLIT_BACKWARD else B


@dataclass(frozen=True)
class Schedule:
    """Every rank's action list for one step, plus the simulated start times of computes."""

    name: str
    p: int  # ranks
    v: int  # stages per rank
    m: int  # micro-batches
    actions: tuple[tuple[Action, ...], ...]  # per rank, in execution order
    start: dict[Action, int] = field(repr=False)  # simulated start of every compute action
    costs: dict[str, int] = field(repr=False)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage_rank(self.name, stage, self.p)

    def stages_of(self, rank: int) -> list[int]:
        return rank_stages(self.name, rank, self.p, self.v)

    @property
    def makespan(self) -> int:
        return max(t + self.costs[a.kind] for a, t in self.start.items())

    def table(self) -> str:
        """Rank rows x time columns; ``F3`` is the forward of micro-batch 3 (``F3.1`` with
        ``v > 1``: on the rank's chunk 1), ``.`` is idle."""
        return format_schedule(self)


# ---- compute orders ------------------------------------------------------------------


def _order_gpipe(p: int, v: int, m: int, r: int) -> list[Action]:
    return [Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)]


def _order_forward(p: int, v: int, m: int, r: int) -> list[Action]:
    return [Action(r + c * p, F, i) for c in range(v) for i in range(m)]


def _order_forward_v(p: int, v: int, m: int, r: int) -> list[Action]:
    # down the V (stage r) for every micro-batch, then back up (stage 2p-1-r)
    return [Action(s, F, i) for s in rank_stages("forward_v", r, p, v) for i in range(m)]


def _order_1f1b(p: int, v: int, m: int, r: int) -> list[Action]:
    warmup = min(p - 1 - r, m)
    out = [Action(r, F, i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action(r, F, warmup + i), Action(r, B, i)]
    return out + [Action(r, B, i) for i in range(m - warmup, m)]


def _order_interleaved(p: int, v: int, m: int, r: int) -> list[Action]:
    # Micro-batches go in rounds of k (k = p when p divides m, else one round of all m);
    # within a round every chunk runs the round's micro-batches before the next chunk.
    if v == 1:  # Megatron's doubled warm-up is only needed between chunks
        return _order_1f1b(p, v, m, r)
    k = p if m % p == 0 else m
    fwd, bwd = [], []
    for start in range(0, m, k):
        mbs = range(start, start + k)
        fwd += [Action(r + c * p, F, i) for c in range(v) for i in mbs]
        bwd += [Action(r + c * p, B, i) for c in reversed(range(v)) for i in mbs]
    total = v * m
    warmup = min((v - 1) * k + 2 * (p - 1 - r), total)
    out = fwd[:warmup]
    for i in range(total - warmup):
        out += [fwd[warmup + i], bwd[i]]
    return out + bwd[total - warmup :]


def _order_zb_h1(p: int, v: int, m: int, r: int) -> list[Action]:
    # 1F1B's order with B the input gradient only; rank r holds back its first r weight
    # gradients (W) and runs them where 1F1B would wait in the drain (torch's ZB-H1 rule).
    warmup = min(p - 1 - r, m)
    out = [Action(r, F, i) for i in range(warmup)]
    w = 0
    for j in range(m):
        if j < m - warmup:
            out.append(Action(r, F, warmup + j))
        out.append(Action(r, B, j))
        if j >= r:
            out.append(Action(r, W, w))
            w += 1
    return out + [Action(r, W, i) for i in range(w, m)]


_ORDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": _order_gpipe,
    "1f1b": _order_1f1b,
    "interleaved_1f1b": _order_interleaved,
    "zb_h1": _order_zb_h1,
    "zbv": order_zbv,
    "dualpipev": order_dualpipev,
    "forward": _order_forward,
    "forward_v": _order_forward_v,
}


def compute_order(name: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    """The compute actions of ``rank`` in the order schedule ``name`` runs them."""
    return _ORDERS[name](p, v, m, rank)


# ---- simulation ----------------------------------------------------------------------


def _deps(a: Action, last: int) -> list[Action]:
    """Compute actions that must finish before ``a`` starts (same or other ranks)."""
    if a.kind == F:
        return [Action(a.stage - 1, F, a.mb)] if a.stage > 0 else []
    if a.kind == B:
        up = Action(a.stage + 1, B, a.mb) if a.stage < last else None
        return [Action(a.stage, F, a.mb)] + ([up] if up else [])
    return [Action(a.stage, B, a.mb)]


def _simulate(orders: list[list[Action]], costs: dict[str, int], last: int) -> dict[Action, int]:
    """ASAP start time of every compute action given each rank's fixed order."""
    start: dict[Action, int] = {}
    free = [0] * len(orders)
    pos = [0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                deps = _deps(a, last)
                if any(d not in start for d in deps):
                    break
                ready = max([start[d] + costs[d.kind] for d in deps], default=0)
                start[a] = max(free[r], ready)
                free[r] = start[a] + costs[a.kind]
                pos[r] += 1
                progressed = True
    stuck = [order[pos[r]] for r, order in enumerate(orders) if pos[r] < len(order)]
    if stuck:
        raise ConfigError(f"schedule deadlocks: ranks wait at {[str(a) for a in stuck]}")
    return start


# ---- comm placement ------------------------------------------------------------------


def _with_comm(name: str, p: int, v: int, start: dict[Action, int], costs: dict[str, int]):
    """Insert sends after their compute and receives in global arrival order."""
    last = p * v - 1
    keyed: list[list[tuple[tuple, Action]]] = [[] for _ in range(p)]
    starts_by_rank: list[list[int]] = [[] for _ in range(p)]
    for a, t in start.items():
        r = stage_rank(name, a.stage, p)
        keyed[r].append(((t, 2, 0), a))
        starts_by_rank[r].append(t)
    for lst in starts_by_rank:
        lst.sort()

    def place(rank: int, arrival: int) -> int:
        return next(t for t in starts_by_rank[rank] if t >= arrival)

    for a, t in start.items():
        end, r = t + costs[a.kind], stage_rank(name, a.stage, p)
        if a.kind == F and a.stage < last and stage_rank(name, a.stage + 1, p) != r:
            dst = stage_rank(name, a.stage + 1, p)
            keyed[r].append(((end, 0, 0), Action(a.stage, SEND_F, a.mb)))
            keyed[dst].append(((place(dst, end), 1, end), Action(a.stage + 1, RECV_F, a.mb)))
        if a.kind == B and a.stage > 0 and stage_rank(name, a.stage - 1, p) != r:
            dst = stage_rank(name, a.stage - 1, p)
            keyed[r].append(((end, 0, 0), Action(a.stage, SEND_B, a.mb)))
            keyed[dst].append(((place(dst, end), 1, end), Action(a.stage - 1, RECV_B, a.mb)))
    return tuple(tuple(a for _, a in sorted(lst)) for lst in keyed)


def build_schedule(
    name: str, p: int, m: int, v: int = 1, costs: dict[str, int] | None = None
) -> Schedule:
    """Every rank's action list for schedule ``name`` (one of ``SCHEDULES``).

    ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank (``interleaved_1f1b`` and
    ``forward`` take any ``v``, ``zbv`` and ``dualpipev`` exactly 2, the rest 1). ``costs`` (per kind, default 1 each) only shape the
    simulated timeline that orders the communication.
    """
    if name not in _ORDERS:
        raise ConfigError(f"pipeline.schedule={name!r} is unknown; use one of {SCHEDULES}")
    for label, val in (("pipeline size p", p), ("micro-batches m", m), ("stages per rank v", v)):
        if not isinstance(val, int) or val < 1:
            raise ConfigError(f"{label}={val!r} must be a positive integer")
    if name in V_SHAPED and v != 2:
        raise ConfigError(
            f"pipeline.schedule={name!r} holds two stages per rank in a V (rank r runs "
            f"stages r and 2p-1-r), got virtual_stages={v}; set pipeline.virtual_stages to 2"
        )
    if name == "dualpipev" and m < 2 * p:
        raise ConfigError(
            f"pipeline.schedule='dualpipev' needs at least 2 x pp = {2 * p} micro-batches "
            f"(gradient_accumulation_steps), got {m}; raise it or use zbv"
        )
    if v > 1 and name not in ("interleaved_1f1b", *FORWARD_ONLY, *V_SHAPED):
        raise ConfigError(
            f"pipeline.schedule={name!r} runs one stage per rank, got "
            f"virtual_stages={v}; use interleaved_1f1b or set virtual_stages to 1"
        )
    costs = {F: 1, B: 1, W: 1, **(costs or {})}
    orders = [_ORDERS[name](p, v, m, r) for r in range(p)]
    start = _simulate(orders, costs, p * v - 1)
    return Schedule(name, p, v, m, _with_comm(name, p, v, start, costs), start, costs)


def format_schedule(schedule: Schedule) -> str:
    """The compute actions as a table: one row per rank, one column per time unit."""
    cols = schedule.makespan
    grid = [["."] * cols for _ in range(schedule.p)]
    for a, t in schedule.start.items():
        label = f"{a.kind}{a.mb}" + (f".{a.stage // schedule.p}" if schedule.v > 1 else "")
        for dt in range(schedule.costs[a.kind]):
            grid[schedule.rank_of(a.stage)][t + dt] = label if dt == 0 else "-"
    width = max(len(c) for row in grid for c in row)
    head = f"{schedule.name}: p={schedule.p} m={schedule.m} v={schedule.v}"
    lines = [head, "time    " + " ".join(f"{t:<{width}}" for t in range(cols))]
    for r, row in enumerate(grid):
        lines.append(f"rank {r:<3}" + " ".join(f"{c:<{width}}" for c in row))
    return "\n".join(lines)
