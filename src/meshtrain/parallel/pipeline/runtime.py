"""Executes one rank's action list: forwards, backwards and the p2p between stages.

What is communicated, per micro-batch and stage boundary, over the ``pp`` group (the
channels, and why every receive is posted early: ``p2p``):

* forward: an 80-byte shape header and the activation (``b * t * d`` elements for a
  transformer); backward: the activation's gradient, no header. A stage may return a
  pytree of tensors instead (``pytree``): every leaf goes forward, only the gradients of
  the leaves that need one come back, and the tree's spec travels when it changes;
* after the last micro-batch: the mean loss broadcast from the last stage (4 bytes), and
  each tied parameter's gradient all-reduced over the ranks holding it (2 x its bytes).

Receives are posted in the order of the schedule, which places them in the global order
of the sends (see ``schedules``), and each is waited on by the compute that consumes it
(``p2p``), so the step cannot deadlock and no compute waits for data it does not need.

Memory: a stage keeps, per alive micro-batch, its input (with ``requires_grad``) and its
output, i.e. the autograd graph between them; ``schedules`` gives the peak count.

The loss of micro-batch ``i`` is divided by ``m`` before backward, so the gradients are
those of the mean loss over the step's micro-batches (the same as one process running
the whole batch with gradient accumulation). A caller that knows better weights passes
``weights`` (the Trainer: each micro-batch's share of the window's label tokens); the
step's loss is then ``sum_i w_i L_i``.

``eval_outputs`` runs the forwards with the last stage returning the model's whole
outputs (``SplitStage.whole_outputs``: loss and logits) and hands them to the caller on
the rank holding the last stage; moving them to other ranks is the caller's choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshtrain.distributed import comm
from meshtrain.errors import ConfigError, TrainingError
from meshtrain.parallel.pipeline import pytree, zero_bubble
from meshtrain.parallel.pipeline.p2p import ShapeMemory, StepLinks
from meshtrain.parallel.pipeline.schedules import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SPLIT_BACKWARD,
    B,
    F,
    W,
    build_schedule,
    stage_rank,
)
from meshtrain.parallel.pipeline.v_shape import V_SHAPED

# Op costs the receives are placed by (``schedules``: a receive sits before the first
# compute that starts after the data's simulated arrival). A backward costs about two
# forwards. The placement decides when a receive is posted, not when it is waited on
# (the consuming compute waits, ``p2p``): when ranks waited at the list position, unit
# costs made interleaved 1F1B block on receives it did not need yet (bubble 0.200
# instead of 0.111 at p 2, m 4, benchmarks/bench_pipeline_bubble.py). The placement stays
# deadlock-free whatever the real costs.
RUN_COSTS = {False: {F: 1, B: 2}, True: {F: 1, B: 1, W: 1}}  # key: backward split (ZB, ZBV)


@dataclass
class _Step:
    """What one step's actions read and write (``PipelineRuntime._run``)."""

    links: StepLinks
    batches: Sequence[Any]
    inputs: dict  # (stage, mb) -> stage input
    outputs: dict  # (stage, mb) -> output / loss
    out_grads: dict  # (stage, mb) -> gradient of the stage's output
    losses: dict  # mb -> its loss (last stage)
    train: bool
    loss_scale: float
    weights: Sequence[float] | None
    kept: dict | None
    m: int
    last: int
    loss_fn: Callable[[Any, int], torch.Tensor] | None = None


class PipelineRuntime:
    """Runs a step of micro-batches through this rank's stages.

    ``stages``: ``{stage index: module}`` for the stages this rank holds (stage ``s`` on
    pp rank ``s % p``, or in a V for zbv / dualpipev: ``schedules.stage_rank``); a module is called ``module(x, batch)`` with ``x`` the previous
    stage's activation (None on stage 0) and returns the activation, or the loss on the
    last stage. ``tied``: ``(parameter, group)`` pairs whose gradients are summed over
    ``group`` after the backward (a weight used by stages on several ranks).
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        group: comm.Group,
        num_stages: int,
        schedule: str = "1f1b",
        tied: Sequence[tuple[nn.Parameter, comm.Group]] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        self.stages, self.group, self.num_stages = dict(stages), group, num_stages
        self.p = group.size
        self.schedule = schedule
        misplaced = any(stage_rank(schedule, s, self.p) != group.rank for s in self.stages)
        if num_stages % self.p or misplaced:
            rule = "in a V (r and 2p-1-r)" if schedule in ("zbv", "dualpipev") else "s % p"
            raise ConfigError(
                f"pp rank {group.rank} of {self.p} holds stages {sorted(self.stages)} of "
                f"{num_stages}; under pipeline.schedule {schedule!r} stages sit {rule}"
            )
        self.v = num_stages // self.p
        self.split = schedule in SPLIT_BACKWARD  # B is the input gradient, W the weights
        self.tied = list(tied)
        self.device = torch.device(device)
        self._cache: dict[tuple, Any] = {}
        self._after_backward: Callable[[list[nn.Parameter]], None] | None = None
        self._midway = False  # a step raised before its end (its receives stay posted)
        self._weight_work: dict[tuple[int, int], zero_bubble.WeightWork] = {}  # split: B -> W
        self._full: frozenset[tuple[int, int]] = frozenset()  # this step's fused B + W
        self._fused_cache: dict[tuple, frozenset[tuple[int, int]]] = {}
        # activation shapes per channel across steps, and the guessed receives (``p2p``)
        self.shapes = ShapeMemory()
        # set to a list to record (kind, stage, mb, start, end, cpu seconds) of every
        # compute action (perf_counter / thread_time): benchmarks/bench_pipeline.py's bubble
        self.trace: list | None = None
        # ZeRO-3: gathers each stage's units per run of the action list (set by the engine,
        # ``parallel.zero.pipeline_gather``); None without stage 3
        self.gathering = None

    def _actions(self, name: str, m: int):
        key = (name, m)
        if key not in self._cache:
            costs = RUN_COSTS[name in SPLIT_BACKWARD]
            self._cache[key] = build_schedule(name, self.p, m, self.v, costs).actions[
                self.group.rank
            ]
        return self._cache[key]

    def _full_backwards(self, m: int) -> frozenset[tuple[int, int]]:
        """The (stage, mb) whose ``B`` the schedule marks full (DualPipeV's unsplit
        backwards, ``Action.full``): run as one backward at ``B``, as torch's
        ``FULL_BACKWARD``, instead of an input pass and a weight pass: one walk of the
        graph, and the weight gradients accumulate where autograd puts them. ZB-H1, ZBV
        and DualPipeV's drain keep their backwards split (a split ``B`` hands its input
        gradient on before ``W`` runs)."""
        key = (self.schedule, m)
        if key not in self._fused_cache:
            self._fused_cache[key] = frozenset(
                (a.stage, a.mb) for a in self._actions(self.schedule, m) if a.kind == B and a.full
            )
        return self._fused_cache[key]

    @property
    def _forward(self) -> str:
        """Evaluation's forward-only schedule on this pipeline's placement."""
        return "forward_v" if self.schedule in V_SHAPED else "forward"

    def rank_of(self, stage: int) -> int:
        """The pp rank holding ``stage`` (``s % p``, or the V of zbv / dualpipev: there
        the last stage is on rank 0)."""
        return stage_rank(self.schedule, stage, self.p)

    def _peer(self, stage: int) -> int:
        return self.rank_of(stage)

    # ---- steps -----------------------------------------------------------------------
    def train_step(
        self,
        batches: Sequence[Any],
        loss_scale: float = 1.0,
        after_backward: Callable[[list[nn.Parameter]], None] | None = None,
        weights: Sequence[float] | None = None,
        loss_fn: Callable[[Any, int], torch.Tensor] | None = None,
        tied_summed: bool = False,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean loss (every rank),
        or ``sum_i weights[i] * loss_i`` when ``weights`` are given.

        Gradients accumulate into the parameters' ``.grad`` as ``loss_scale x`` those of
        the mean loss (of the weighted sum); tied parameters' gradients are summed over
        their ranks.
        ``after_backward``: called after each micro-batch's weight-gradient backward on a
        stage with the parameters whose ``.grad`` that backward wrote without autograd's
        accumulation hooks (ZB-H1), e.g. ``ZeroStage.after_backward`` (ZeRO 2
        reduce-scatters and drops ``.grad`` there; tied weights are then summed by the
        caller, ``grads.sum_tied_shards``, who says so with ``tied_summed``).
        ``loss_fn(outputs, i)``: the loss of micro-batch ``i`` from the last stage's whole
        outputs (``whole_outputs``: the model's outputs, not its loss), computed on the
        last stage per micro-batch; the Trainer's ``compute_loss`` goes here. Without it
        the last stage's module returns the loss itself.
        """
        for st in self.stages.values():
            st.train()
        self._after_backward = after_backward
        try:
            if weights is not None and len(weights) != len(batches):
                raise ConfigError(
                    f"train_step: {len(weights)} weights for {len(batches)} micro-batches"
                )
            actions = self._actions(self.schedule, len(batches))
            self._full = self._full_backwards(len(batches))
            loss = self._run(actions, batches, True, loss_scale, weights, loss_fn=loss_fn)
        finally:
            self._after_backward = None
            self._full = frozenset()
        if tied_summed:
            return loss
        for param, group in self.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            comm.all_reduce(param.grad, group, label="pp_tied")
        return loss

    @torch.no_grad()
    def eval_step(self, batches: Sequence[Any]) -> torch.Tensor:
        """Forward of every micro-batch (any shapes); returns the mean loss on every rank."""
        for st in self.stages.values():
            st.eval()
        return self._run(self._actions(self._forward, len(batches)), batches, False, 1.0)

    @torch.no_grad()
    def eval_outputs(self, batches: Sequence[Any]) -> list[Any] | None:
        """Forward of every micro-batch with the last stage returning the model's whole
        outputs (``whole_outputs``); the list of them in micro-batch order on the rank
        holding the last stage, None on the others. No collective beyond the p2p."""
        last = self.stages.get(self.num_stages - 1)
        for st in self.stages.values():
            st.eval()
        kept: dict[int, Any] = {}
        if last is not None:
            last.whole_outputs = True
        try:
            self._run(self._actions(self._forward, len(batches)), batches, False, 1.0, kept=kept)
        finally:
            if last is not None:
                last.whole_outputs = False
        return None if last is None else [kept[i] for i in range(len(batches))]

    def _run(
        self,
        actions,
        batches,
        train: bool,
        loss_scale: float,
        weights=None,
        kept=None,
        loss_fn=None,
    ) -> torch.Tensor:
        if self._midway:
            raise TrainingError(
                "the previous pipeline step on this rank raised before it finished: its "
                "receives are still posted on the pp group and would take this step's "
                "data; restart the job (the other stages are stuck in that step)"
            )
        self._midway = True
        m, last = len(batches), self.num_stages - 1
        inputs: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> stage input
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output / loss
        out_grads: dict[tuple[int, int], torch.Tensor] = {}  # grad of the stage's output
        losses: dict[int, torch.Tensor] = {}  # mb -> its loss (last stage)
        links = StepLinks(self.group, actions, outputs, self.device, self.shapes, self._peer)
        step = _Step(links, batches, inputs, outputs, out_grads, losses, train, loss_scale,
                     weights, kept, m, last, loss_fn)  # fmt: skip
        gathering, computes = self.gathering, 0
        if gathering is not None:
            gathering.begin_step([a.stage for a in actions if a.kind in COMPUTE])
        with gathering.paused() if gathering is not None else nullcontext():
            for i, a in enumerate(actions):
                if a.kind in COMPUTE and gathering is not None:
                    gathering.before(computes)
                    computes += 1
                self._act(i, a, step)
        if gathering is not None:
            gathering.end_step(keep=train)
        links.finish()
        if kept is not None:
            self._midway = False
            return torch.zeros(())
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses and weights is None:
            loss = torch.stack([losses[i] for i in sorted(losses)]).mean()
        elif losses:
            loss = sum(losses[i] * float(weights[i]) for i in sorted(losses))
        comm.broadcast(loss, src=self._peer(last), group=self.group, label="pp_loss")
        self._midway = False
        return loss

    def _act(self, i: int, a, st: _Step) -> None:
        """Run action ``i`` of the step's list (``_run``'s loop body) on ``st``."""
        key = (a.stage, a.mb)
        if a.kind in COMPUTE:
            st.links.post_ahead(i)
            self._fetch(a, st.links, st.inputs, st.out_grads, st.train)
        if self.trace is not None:
            t0, c0 = time.perf_counter(), time.thread_time()
        if a.kind == F:
            x = st.inputs.get(key) if a.stage > 0 else None
            if a.stage == st.last and st.loss_fn is not None and st.kept is None:
                y = st.loss_fn(_whole(self.stages[a.stage], x, st.batches[a.mb]), a.mb)
            else:
                y = self.stages[a.stage](x, st.batches[a.mb])
            if a.stage == st.last and st.kept is None:
                st.losses[a.mb] = y.detach().float()
                w = 1.0 / st.m if st.weights is None else float(st.weights[a.mb])
                y = y * (st.loss_scale * w)
            if a.stage == st.last and st.kept is not None:  # eval_outputs: nothing goes on
                st.inputs.pop(key, None)
                st.kept[a.mb] = y
            elif st.train:
                st.outputs[key] = y
            else:
                st.inputs.pop(key, None)
                st.outputs[key] = pytree.detach(y, False)
            if a.stage < st.last and self._peer(a.stage + 1) == self.group.rank:
                nxt = pytree.detach(y, st.train)  # p == 1, or the V's bottom
                st.inputs[(a.stage + 1, a.mb)] = nxt
        elif a.kind == SEND_F:
            st.links.send_activation(st.outputs[key], a.stage)
            if not st.train:
                del st.outputs[key]
        elif a.kind in (RECV_F, RECV_B):
            pass  # posted by post_ahead, waited on by the compute that consumes it
        elif a.kind in (B, W):
            self._backward(key, st.inputs, st.outputs, st.out_grads, split=a.kind == W)
        elif a.kind == SEND_B:
            st.links.send_gradient(pytree.input_grads(st.inputs.pop(key)), a.stage)
        if self.trace is not None and a.kind in (F, B, W):
            cpu = time.thread_time() - c0
            self.trace.append((a.kind, a.stage, a.mb, t0, time.perf_counter(), cpu))

    def _fetch(self, a, links: StepLinks, inputs, out_grads, train: bool) -> None:
        """Wait for the data compute ``a`` consumes from another rank, if any: a forward's
        input; a backward's output gradient (B's, except ZB-H1's B on stage 0, a no-op
        with no input gradient to compute, whose W then needs it)."""
        key, rank = (a.stage, a.mb), self.group.rank
        if a.kind == F:
            if a.stage > 0 and self._peer(a.stage - 1) != rank:
                inputs[key] = links.activation(*key, train=train)
            return
        if a.kind == W and key in self._full:
            return  # its B ran the whole backward (``_full_backwards``)
        remote = a.stage < self.num_stages - 1 and self._peer(a.stage + 1) != rank
        zb_first = self.split and a.stage == 0 and key not in self._full
        if remote and key not in out_grads and (a.kind == W or not zb_first):
            out_grads[key] = links.gradient(*key)

    def _backward(self, key, inputs, outputs, out_grads, split: bool) -> None:
        """``B`` (and ``W`` for the split schedules): ``B`` alone runs the whole backward;
        under ZB-H1, ZBV and DualPipeV ``B`` computes the input gradient and ``W`` the weight
        gradients, each walking its own part of the graph once (``zero_bubble``)."""
        stage, mb = key
        if key in self._full:
            if split:  # its W: the backward at B did the weights too
                return
            zb = False  # the whole backward now, as an unsplit schedule's
        else:
            zb = self.split
        # a pytree output's gradient leaves and their gradients (``pytree``); one each for
        # a tensor, the loss on the last stage (its gradient None)
        y, grad = _with_grads(outputs[key], out_grads.get(key))
        x = inputs.get(key)
        xs = pytree.grad_leaves(x) if x is not None else []
        local_prev = stage > 0 and self._peer(stage - 1) == self.group.rank
        if zb and not split:  # input gradient only (nothing to do on stage 0)
            if xs and y:
                params = self.stages[stage].parameters()
                self._weight_work[key] = zero_bubble.backward_input(y, grad, xs, params)
            if local_prev:  # the V's bottom: the previous stage's B may run before our W
                out_grads[(stage - 1, mb)] = pytree.input_grads(inputs.pop(key))
            return
        outputs.pop(key)
        out_grads.pop(key, None)
        work = self._weight_work.pop(key, None) if zb else None
        written: list[nn.Parameter] = []  # .grad set outside autograd's hooks
        if work is not None:  # weight gradients from what B saved (``zero_bubble``)
            written = zero_bubble.backward_weight(work)
        elif zb and y:  # stage 0: the whole backward, towards the parameters
            params = [p for p in self.stages[stage].parameters() if p.requires_grad]
            torch.autograd.backward(y, grad, inputs=params)
        elif y:  # (no output leaf needing a gradient: nothing flows back from here)
            torch.autograd.backward(y, grad)
        if self._after_backward is not None:
            self._after_backward(written)
        if local_prev and not zb:  # same-rank hand-over (p == 1; split: done by B)
            out_grads[(stage - 1, mb)] = pytree.input_grads(inputs.pop(key))


def _whole(stage: nn.Module, x, batch):
    """The last stage's whole outputs (the model's, not its loss): a stage that returns
    its loss by default has a ``whole_outputs`` switch (``SplitStage``)."""
    if not hasattr(stage, "whole_outputs"):
        return stage(x, batch)
    stage.whole_outputs = True
    try:
        return stage(x, batch)
    finally:
        stage.whole_outputs = False


def _with_grads(y, grad) -> tuple[list[torch.Tensor], list | None]:
    """A stage output's tensors that get a gradient, with those gradients (``grad``: a
    tensor, the list a tree's gradients travel as, or None for the last stage's loss)."""
    ys = pytree.grad_leaves(y)
    if grad is None:
        return ys, None
    return ys, [grad] if isinstance(grad, torch.Tensor) else list(grad)
