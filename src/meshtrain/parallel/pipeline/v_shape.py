"""The V-shaped zero-bubble schedules: where their stages sit and their compute orders.

zbv (torch's ``ScheduleZBVZeroBubble``; Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", section 6) and dualpipev (torch's ``ScheduleDualPipeV``: DeepSeek-V3's
DualPipe folded into a V, from deepseek-ai/DualPipe) cut the model into ``2 p`` stages
and give rank ``r`` stages ``r`` and ``2 p - 1 - r``: a micro-batch walks down the ranks
and back up, so the last stage sits beside the first on rank 0 and stages ``p - 1`` and
``p`` hand over in memory on rank ``p - 1``. The backward is split (``B`` the input
gradient, ``W`` the weights'), and the ``W``'s fill what would be the drain's bubble.

The orders are torch's, action for action (``tests/parallel/test_pipeline_v_schedules.py``
reads torch's own rule and compares); the bubble and the activation peaks they reach are
in ``schedules``' docstring. ``schedules.build_schedule`` turns an order into action lists
with their communication, as for every other schedule.
"""

from __future__ import annotations

from meshtrain.parallel.pipeline.actions import Action, B, F, W

# two stages per rank in a V: rank r holds stage r and stage 2p - 1 - r (torch's "v" style)
# forward_v: evaluation's forward-only pass over the V placement (the runtime picks it
# for a zbv / dualpipev pipeline; ``forward`` is the looped placement's)
V_SHAPED = ("zbv", "dualpipev", "forward_v")


def stage_rank(name: str, stage: int, p: int) -> int:
    """The pp rank holding ``stage`` under schedule ``name``: looped (``stage % p``), or
    V-shaped for zbv / dualpipev (stages ``0..p-1`` down the ranks, ``p..2p-1`` back up,
    so the last stage sits on rank 0 beside the first)."""
    if name in V_SHAPED:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def rank_stages(name: str, rank: int, p: int, v: int) -> list[int]:
    """The stages pp rank ``rank`` holds, in chunk order (``stage_rank``'s inverse)."""
    if name in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return [rank + c * p for c in range(v)]


def order_zbv(p: int, v: int, m: int, r: int) -> list[Action]:
    # torch's ScheduleZBVZeroBubble order (Qi et al. 2024, "Zero Bubble Pipeline
    # Parallelism", section 6): chunk 0 (stage r) warms up with 2 (p - r) - 1 forwards,
    # then chunk 1 (stage 2p-1-r) joins; the steady state alternates F B W of each chunk,
    # and the drain runs the held-back W's where the ranks would idle. Orders for at
    # least 2p - 1 micro-batches are cut down to m, as torch does.
    n = max(2 * p - 1, m)
    s0, s1 = r, 2 * p - 1 - r
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - r) - 1):
        out.append(Action(s0, F, f0))
        f0 += 1
    for _ in range(r):
        out += [Action(s1, F, f1), Action(s0, F, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - r):
        out += [Action(s1, F, f1), Action(s1, B, b1), Action(s1, W, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(Action(s0, F, f0))
            f0 += 1
        out += [Action(s0, B, b0), Action(s0, W, b0)]
        out += [Action(s1, F, f1), Action(s1, B, b1), Action(s1, W, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [Action(s0, B, b0), Action(s1, B, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - r):
        out += [Action(s0, B, b0), Action(s0, W, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [Action(s1, W, i) for i in range(w1, b1)]
    out += [Action(s0, W, i) for i in range(w0, b0)]
    return [a for a in out if a.mb < m]


def order_dualpipev(p: int, v: int, m: int, r: int) -> list[Action]:
    # torch's ScheduleDualPipeV order (DeepSeek-V3's DualPipe folded into a V, from
    # deepseek-ai/DualPipe), in its eight steps. A full backward is B then W at once (run
    # as one backward: ``Action.full``); a split one (the drain, "zero bubble") queues its
    # W, run oldest first where a rank would idle. torch overlaps a forward of one chunk with a backward of the other
    # (OVERLAP_F_B, for compute/communication overlap); here they run one after the
    # other, which is the same order of computes.
    s0, s1 = r, 2 * p - 1 - r
    out: list[Action] = []
    nxt = {(s0, F): 0, (s1, F): 0, (s0, B): 0, (s1, B): 0}
    queue: list[tuple[int, int]] = []  # (stage, mb) of B's whose W is held back

    def fwd(st: int) -> None:
        out.append(Action(st, F, nxt[st, F]))
        nxt[st, F] += 1

    def bwd(st: int, split: bool) -> None:
        i = nxt[st, B]
        nxt[st, B] += 1
        out.append(Action(st, B, i, full=not split))
        if split:
            queue.append((st, i))
        else:
            out.append(Action(st, W, i))

    def pending_w() -> None:
        if queue:
            st, i = queue.pop(0)
            out.append(Action(st, W, i))

    for _ in range(2 * (p - r - 1)):  # 1: F0
        fwd(s0)
    for _ in range(r + 1):  # 2: F0 F1
        fwd(s0)
        fwd(s1)
    for _ in range(p - r - 1):  # 3: I1 W1 F1
        bwd(s1, True)
        pending_w()
        fwd(s1)
    for _ in range(m - 2 * p + r + 1):  # 4: F0 B1, F1 B0
        fwd(s0)
        bwd(s1, False)
        fwd(s1)
        bwd(s0, False)
    for _ in range(p - r - 1):  # 5: B1, F1 B0
        bwd(s1, False)
        fwd(s1)
        bwd(s0, False)
    split = False
    half = (r + 1) // 2
    for i in range(r + 1):  # 6: B1 B0, the second half split
        if i == half and r % 2 == 1:
            split = True
        bwd(s1, split)
        if i == half and r % 2 == 0:
            split = True
        bwd(s0, split)
    for _ in range(p - r - 1):  # 7: W0 B0
        pending_w()
        bwd(s0, split)
    for _ in range(r + 1):  # 8: W0
        pending_w()
    return out
