"""ZeRO stage 3 under a pipeline: each stage's units gathered per run of the action list.

What is sharded: as under plain ZeRO-3 (``stage3``), every unit's parameters live as
``1/dp`` shards over the ranks holding the same stage (the stage's replica group); a
stage's optimizer states and master weights stay sharded for the whole step.

When a stage is whole. The pipeline runtime tells this object the compute action it is
about to run (``before(stage, next_stage)``). A *run* is a maximal sequence of consecutive
compute actions of a rank's list on one stage: before the first action of a run its
stage's units are all-gathered (unit by unit, each unit's buckets in one coalesced
all-gather, ``ParamGatherer.gather``), and when the next compute action is on another
stage the run's stage is released (storage resized to 0 bytes; autograd's saved views
stay valid objects and see the values again when the stage is gathered for its next run),
unless it is the next run's stage, which stays whole (so at most two stages are whole at
once, and a rank alternating between its two stages, as zbv does, gathers each once).
So a stage is gathered once per run, not once per micro-batch: with one stage per rank
(GPipe, 1F1B, ZB-H1) the whole step is one run, one all-gather per unit per step; under
interleaved 1F1B each chunk is gathered once per round of forwards or backwards.
Prefetch: when a run starts, the all-gathers of the next run's stage are started too
(asynchronously), so they travel while this run computes. ``runs`` counts the runs per
stage, ``gathers`` the all-gathers actually made (a stage already whole is not gathered
again). The unit hooks of ``ParamGatherer`` are paused for the step (``paused``): nothing
else gathers.

Gradients accumulate in each parameter's ``.grad`` over the step's micro-batches and are
reduce-scattered once, after the schedule (``ZeroStage.every_backward`` is off under a
pipeline; the reducer's ``finish`` frees each bucket once it is handed to the collective).

Bytes per step on a rank, its stages' sharded units of ``Psi_s`` padded elements of ``c``
bytes: ``c sum_s gathers_s Psi_s`` gathered plus ``c Psi`` reduce-scattered (``Psi`` the
rank's sharded elements), plus the persistent (small, whole) parameters' stage-2 traffic
(``plan.pipeline_comm_bytes``): with one stage per rank ``2 c Psi``, against plain
ZeRO-3's ``3 c Psi`` per micro-batch. The price is memory: a stage's parameters are
whole, and its gradients full-size, while its run lasts (a run of one stage per rank is
the whole step).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from torch import nn


class StageGathering:
    """Gathers and releases a rank's pipeline stages around the runs of its action list.

    ``gatherers``: the ZeRO-3 ``ParamGatherer``s of the engine (non-expert and expert);
    ``stages``: ``{stage index: module}`` of this rank.
    """

    def __init__(self, gatherers, stages: dict[int, nn.Module]) -> None:
        self.gatherers = list(gatherers)
        self.units: dict[int, list] = {}  # stage -> [(gatherer, unit)] inside it
        for k, module in stages.items():
            inside = {id(m) for m in module.modules()}
            self.units[k] = [
                (g, u) for g in self.gatherers for u in g.units if id(u.module) in inside
            ]
        self.whole: set[int] = set()  # stages gathered (or being gathered) now
        self.runs: dict[int, int] = dict.fromkeys(stages, 0)  # runs this step, per stage
        self.gathers: dict[int, int] = dict.fromkeys(stages, 0)  # all-gathers this step
        self._next: list[int | None] = []  # per compute action: the next run's stage

    def begin_step(self, stages: list[int]) -> None:
        """``stages``: the stage of each compute action of this step, in list order."""
        self.runs = dict.fromkeys(self.runs, 0)
        self.gathers = dict.fromkeys(self.gathers, 0)
        self._next, upcoming = [None] * len(stages), None
        for i in range(len(stages) - 1, -1, -1):
            self._next[i] = upcoming
            if i and stages[i - 1] != stages[i]:
                upcoming = stages[i]
        self._stages = stages

    def before(self, i: int) -> None:
        """Before compute action ``i`` of the step (its index among the computes)."""
        stage = self._stages[i]
        if i and self._stages[i - 1] == stage:
            return  # inside a run: the stage is whole
        nxt = self._next[i]
        for other in [s for s in self.whole if s not in (stage, nxt)]:
            self.release(other)  # its run ended and it is not the next one's
        if stage not in self.whole:
            self.gathers[stage] += 1
            self.whole.add(stage)
        for g, unit in self.units[stage]:  # waits for a prefetch; a whole unit moves nothing
            g.gather(unit)
        self.runs[stage] += 1
        if nxt is not None and nxt not in self.whole:  # prefetch while this run computes
            for g, unit in self.units[nxt]:
                g.start(unit)
            self.gathers[nxt] += 1
            self.whole.add(nxt)

    @contextmanager
    def paused(self):
        """The unit hooks of every gatherer do nothing inside (this object gathers)."""
        with ExitStack() as stack:
            for g in self.gatherers:
                stack.enter_context(g.paused())
            yield

    def release(self, stage: int) -> None:
        for g, unit in self.units[stage]:
            g.release(unit)
        self.whole.discard(stage)

    def end_step(self, keep: bool) -> None:
        """After the schedule: release every stage, unless ``keep`` (training: the
        reduction after the schedule frees each bucket as it hands it to the
        collective, ``GradReducer.on_reduced``)."""
        for stage in list(self.whole):
            if not keep:
                self.release(stage)
                continue
            for g, unit in self.units[stage]:  # frozen buckets have no gradient to reduce
                for fg, b in unit.frozen:
                    g.release_bucket(fg, b)
        self.whole.clear()
