"""The ZeRO stage the Engine, the Accelerator and the pipeline call: the whole contract
for the gradients between backward and the optimizer step, over one part per kind of
parameter (``ZeroPart``: a model without experts is one part).

The contract (nothing outside ``parallel/zero`` reads or writes a gradient buffer)::

    loss_multiplier(s, k)   what a backward multiplies its loss by: the loss scale ``s``
                            over ``k`` micro-steps and the pre-division ``f``; remembers ``s``
    begin_window() / before_backward(b) / after_backward()     the reduction (``ZeroPart``)
    average_()              a synchronising backward's end: stages 0-1 finish the
                            reduction and divide by ``dp / f`` in place, so ``p.grad`` is
                            the data-parallel mean (DeepSpeed's and DDP's contract)
    grad_scale              the one number the gradients in the buffers carry now over
                            the true (averaged, unscaled) gradient: ``s x (dp / f) /
                            (what was divided in place)``; 1.0 once unscaled or clipped
    full_grad(p)            the whole averaged gradient of one parameter (a collective)
    grad_norm(leave_out)    the global L2 norm over every shard and part (still scaled)
    unscale_() / clip_(c)   in place: divide by ``grad_scale``; and clip to norm ``c``
    step(optimizer, f) / after_step()                         the masters step, a new window

Why one number. The reduced gradient is ``s x (dp / f) x g`` after the reduction and
``s x g`` once averaged in place (``average_``), ``g`` after ``unscale_`` or ``clip_``; the
step divides by what is left (``1 / grad_scale``) on its way into the fp32 masters, a pass
it makes anyway, so no extra pass is added and none is made twice.

Two kinds of parameters. With expert parallelism (``mesh.expert_parallel_size`` = ``ep``
> 1) a rank holds two kinds of trainable parameters (``is_expert_param``):

==============  ==========================  ========================  ====================
kind            the same copy lives on      reduced / ZeRO-sharded    gradient divided by
==============  ==========================  ========================  ====================
non-expert      dp x cp ranks (replicas)    over ``replica_group``    ``dp x cp``
expert          dp x cp / ep ranks (edp)    over ``edp``              ``dp x cp`` (not edp)
==============  ==========================  ========================  ====================

Why the expert divisor is ``dp x cp``. Let ``W = dp x cp`` ranks each compute their loss
``L_r`` as the mean over their own tokens, so the single-process loss over the same
(equally split) batch is ``L = (1/W) sum_r L_r`` and ``dL/dw = (1/W) sum_r dL_r/dw``.
A non-expert weight sees only its own rank's tokens: its local gradient is ``dL_r/dw``,
summed over the W replicas and divided by W. An expert ``e`` lives on one ep rank ``j``
of each ep group; the token all-to-all brings it the tokens of every rank ``r`` of that ep
group, and its backward returns ``dL_r/dy`` to it from each of them, so the local
gradient on ``j`` is already ``sum_{r in ep group} dL_r/dw_e``. Summing that over the
edp replicas of ``j`` (one per ep group; the ep groups partition the W ranks) gives
``sum_{all W ranks} dL_r/dw_e``: the same sum as a non-expert weight's, so the same
divisor ``W`` gives ``dL/dw_e`` exactly. Dividing by edp instead (``W / ep``) would scale
the expert gradients up by ``ep``. Both kinds therefore share one ``grad_divisor`` and
one ``predivide`` (one backward multiplier and one scaling pass), and no caller knows
of experts.

Global-norm clipping: ``|g|^2 = |g_non-expert|^2 + |g_expert|^2``. The non-expert part is
each rank's owned chunks summed over the replicas (when sharded), the same on every rank.
The expert part is summed over edp (when sharded) and then over the ep group, whose ranks
hold *different* experts; nothing is counted twice because an ep group holds each expert
once and edp shards are disjoint. Two scalar all-reduces, recorded under ``control``.

Bytes per optimizer step (``plan.comm_bytes_theory`` per part): the non-expert part's
under the ``dp`` (or ``dp_cp``) group, the expert part's under ``edp``, with ``Psi`` each
part's padded flat size; an ``edp`` of one rank (``ep = dp x cp``) moves nothing.

No hang under any routing. Reductions of expert gradients are launched only at the end
of backward (``finish``), bucket by bucket in a fixed order: which expert buckets fill
during backward depends on this rank's routing, so launching them as they fill would
order the collectives differently on different ranks (the ZeRO-3 deadlock of
DeepSpeed#4808). A bucket whose expert got no token contributes zeros. Under ZeRO-3 the
expert weights are gathered over edp by the same unit hooks as the rest (a unit is a
block, which every rank runs whatever its routing), so every rank gathers every unit it
owns.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch import nn

from meshtrain.distributed import comm
from meshtrain.distributed.topology import Group, Topology
from meshtrain.errors import ConfigError
from meshtrain.parallel.experts import is_expert_param
from meshtrain.parallel.zero.gatherers import Gatherers
from meshtrain.parallel.zero.part import ZeroPart


def kind_groups(groups: list[dict], expert: bool) -> tuple[list[dict], list[int]]:
    """The groups restricted to one kind, the empty ones dropped, and their indices."""
    kept, index = [], []
    for i, g in enumerate(groups):
        params = [p for p in g["params"] if is_expert_param(p) == expert]
        if params:
            kept.append({**g, "params": params})
            index.append(i)
    return kept, index


class ZeroStage:
    """The model's ZeRO stage: one ``ZeroPart`` over ``topology.replica_group``, or, when
    ``ep > 1`` and some parameters are experts, one for the non-expert parameters and one
    for the experts (over ``edp``, divided by dp x cp), behind one lifecycle and the
    gradient contract (module docstring)."""

    def __init__(self, model: nn.Module, groups: list[dict], config, topology: Topology) -> None:
        self.stage = int(config.zero_optimization.stage)
        self.topology = topology
        self.dense: ZeroPart | None = None
        self.experts: ZeroPart | None = None  # None: no expert part (ep 1, or no experts)
        # frozen experts count too: under ZeRO-3 they are sharded over edp, never over dp
        has_experts = any(is_expert_param(p) for p in model.parameters())
        if topology.ep_size == 1 or not has_experts:
            self.dense = ZeroPart(model, groups, config, topology)
            self.parts: list[ZeroPart] = [self.dense]
            self.per_group = self.dense.per_group
        else:
            self.parts = self._expert_parts(model, groups, config, topology)
        first = self.parts[-1]  # the expert part when there is one (its divisor is dp x cp)
        self.every_backward = first.every_backward
        self.predivide = first.predivide
        self.grad_divisor = first.grad_divisor
        assert all(p.grad_divisor == self.grad_divisor for p in self.parts)
        # the ranks holding the same copy of the model's (non-expert) weights
        self.replicas: Group = topology.replica_group if self.dense is None else self.dense.replicas
        self.flat_groups = [fg for part in self.parts for fg in part.flat_groups]
        self.frozen_groups = [fg for part in self.parts for fg in part.frozen_groups]
        found = self.gatherers
        # one part: its own gatherer (its units, its bytes); two: both behind one face
        self.gatherer = (found[0] if len(self.parts) == 1 else Gatherers(found)) if found else None
        self._loss_scale = 1.0  # the loss scale the window's backwards used
        self._divided_by = 1.0  # what the reduced gradients were divided by in place since
        # from a synchronising backward until the step: the gradients are final (DeepSpeed's
        # safe_get_full_grad interval)
        self.grads_ready = False

    def _expert_parts(self, model, groups, config, topology: Topology) -> list[ZeroPart]:
        dense, dense_index = kind_groups(groups, expert=False)
        experts, expert_index = kind_groups(groups, expert=True)
        replicas = topology.replica_group
        parts = []
        if dense:
            self.dense = ZeroPart(
                model,
                dense,
                config,
                topology,
                replicas,
                frozen_select=lambda p: not is_expert_param(p),
            )
            parts.append(self.dense)
        self.experts = ZeroPart(
            model,
            experts,
            config,
            topology,
            topology.group("edp"),
            average_over=replicas.size,  # the single-process gradient (module docstring)
            across=topology.group("ep"),  # other ep ranks hold other experts
            frozen_select=is_expert_param,
            overlap=False,  # routing-dependent fill order must not order collectives
        )
        parts.append(self.experts)
        per_group: list[list] = [[] for _ in groups]
        for part, index in ((self.dense, dense_index), (self.experts, expert_index)):
            if part is not None:
                for i, fgs in zip(index, part.per_group, strict=True):
                    per_group[i].extend(fgs)
        self.per_group = per_group
        return parts

    @property
    def gatherers(self) -> list:
        """Stage 3: each part's ``ParamGatherer`` (empty below stage 3, or once released)."""
        return [p.gatherer for p in self.parts if p.gatherer is not None]

    # the lifecycle: every part, in a fixed order ------------------------------------------
    def wait_params(self) -> None:
        for part in self.parts:
            part.wait_params()

    def begin_window(self) -> None:
        for part in self.parts:
            part.begin_window()

    def loss_multiplier(self, loss_scale: float, micro_steps: int) -> float:
        """What a backward multiplies its loss by: ``loss_scale / (micro_steps x f)``
        (``f``: the pre-division, module docstring of ``part``); ``loss_scale`` is what
        the gradients then carry (``grad_scale``)."""
        self._loss_scale = loss_scale
        return loss_scale / (micro_steps * self.predivide)

    def before_backward(self, boundary: bool) -> None:
        for part in self.parts:
            part.before_backward(boundary)

    def after_backward(self, written=()) -> None:
        for part in self.parts:
            part.after_backward(written)

    def before_step(self) -> None:
        for part in self.parts:
            part.before_step()

    def keep_local_window(self) -> None:
        """Stage 0, a window whose backwards all ran inside ``no_sync`` and that is stepped
        (local SGD): nothing is reduced, the step uses this rank's own gradient, which
        carries the loss scale over ``f`` only (``grad_scale``)."""
        if self.experts is not None:
            # an expert's gradient already sums the tokens of its whole ep group (the
            # all-to-all), so "this rank's own gradient" has no meaning for it
            raise ConfigError(
                "optimizer.step() after backward passes all inside no_sync (local SGD): under "
                "expert parallelism an expert's gradient holds its ep group's tokens, not this "
                "rank's; set mesh.expert_parallel_size to 1, or step after a synchronising "
                "backward"
            )
        self.dense.keep_local_window()
        self._divided_by = self.grad_divisor * self.predivide
        self.grads_ready = True

    @property
    def synchronising(self) -> bool:
        return all(part.synchronising for part in self.parts)

    @property
    def window_reduced(self) -> bool:
        return any(part.window_reduced for part in self.parts)

    def finish_window_reduction(self) -> None:
        for part in self.parts:
            part.finish_window_reduction()

    # the gradient contract ------------------------------------------------------------------
    def average_(self) -> None:
        """A synchronising backward's end (module docstring). Stages 0-1: wait for the
        buckets in flight, launch the rest and divide by ``dp / f`` in place (stage 1 then
        drops ``p.grad``: each rank holds only its slice); inside ``no_sync`` nothing is
        reduced yet and the step does it. Stages 2-3 reduced in backward already."""
        if self.stage < 2:
            if not self.synchronising:
                return
            # directly, not through before_step: a second synchronising backward in one
            # window (a GAN's discriminator reached again) reduces again, and adds to the
            # average (what it held plus the mean of what was added since: DDP's result)
            self.finish_window_reduction()
            if self.grad_divisor != 1.0:
                for part in self.parts:
                    part.scale_grads_(1.0 / self.grad_divisor)
            self._divided_by = self.grad_divisor
            for part in self.parts:
                part.unlink_sharded_grads()
        self.grads_ready = True

    @property
    def grad_scale(self) -> float:
        """The factor the gradients in the buffers carry now over the true gradient (the
        data-parallel mean, unscaled): the loss scale x ``dp / f``, over what was divided
        in place since the window's reduction (module docstring)."""
        return self._loss_scale * self.grad_divisor / self._divided_by

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole gradient of ``param`` averaged over its replicas, still carrying the
        loss scale (DeepSpeed's ``safe_get_full_grad``): stage 0 its ``.grad``, stages
        1-3 assembled in fp32 by one all-reduce over its part's replicas, so every rank
        must call it for the same parameter; ``param.grad`` for a parameter ZeRO does
        not hold."""
        divisor = self.grad_divisor / self._divided_by
        for part in self.parts:
            out = part.full_grad(param, divisor)
            if out is not None:
                return out
        return param.grad

    def owned_grad_views(self, param: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
        for part in self.parts:
            views = part.owned_grad_views(param)
            if views is not None:
                return views
        return []

    def grad_square_sum(self) -> torch.Tensor:
        sq = self.parts[0].grad_square_sum()
        for part in self.parts[1:]:
            sq = sq + part.grad_square_sum()
        return sq

    def grad_norm(self, leave_out=()) -> float:
        """L2 norm of the reduced gradients over every shard and part (expert squares
        summed over ep; still carrying ``grad_scale``); inf/NaN if any overflowed.
        ``leave_out``: parameters whose gradient is not counted here (a tied weight's later
        holders under a pipeline): zeroed while the norm is taken, then put back, so
        nothing is a difference of two sums."""
        later = [v for p in leave_out for v, _ in self.owned_grad_views(p)]
        saved = [v.clone() for v in later]
        for v in later:
            v.zero_()
        norm = float(self.grad_square_sum().sqrt())
        for v, keep in zip(later, saved, strict=True):
            v.copy_(keep)
        return norm

    def unscale_(self) -> None:
        """Divide the gradients by ``grad_scale`` in place: they are the true gradient now
        (``grad_scale`` 1.0), what ``p.grad`` shows before a user's own clipping."""
        unscale = self.grad_scale
        if unscale != 1.0:
            for part in self.parts:
                part.scale_grads_(1.0 / unscale)
        self._divided_by = self._loss_scale * self.grad_divisor

    def clip_(self, max_norm: float, norm: float | None = None) -> float:
        """Unscale and clip the gradients in place to global L2 norm ``max_norm`` (one
        pass); returns the norm before clipping, unscaled (inf/NaN: nothing is clipped and
        the step skips). ``norm``: the still-scaled global norm when the caller took it
        over more than this stage (a pipeline's stages; default ``grad_norm()``)."""
        unscale = self.grad_scale
        value = (self.grad_norm() if norm is None else norm) / unscale
        coef = min(1.0, float(max_norm) / (value + 1e-6)) if math.isfinite(value) else 1.0
        for part in self.parts:
            part.scale_grads_(coef / unscale)
        self._divided_by = self._loss_scale * self.grad_divisor
        return value

    def sum_tied_grad(self, param: torch.Tensor, holders: Group, dp_group: Group) -> None:
        """Sum ``param``'s sharded reduced gradient over ``holders`` (other ranks holding
        their own copy of it: a pipeline's tied weight): each rank writes its owned part
        into a zero tensor of the weight's size, an all-reduce over ``dp_group`` assembles
        it, one over ``holders`` sums it, and each rank copies its owned part back (bytes:
        ``2 x`` the weight over each, labelled ``pp_tied``)."""
        parts = self.owned_grad_views(param)
        full = torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
        for view, where in parts:
            full[where] = view
        if dp_group.size > 1:
            comm.all_reduce(full, dp_group, label="pp_tied")
        comm.all_reduce(full, holders, label="pp_tied")
        for view, where in parts:
            view.copy_(full[where])

    def relink_grads(self, divide_16bit_by: float) -> None:
        """Stage 0 after the step: ``p.grad`` is its view of the flat buffer again (DDP
        keeps the step's gradient until ``zero_grad``), 16-bit gradients divided by
        ``divide_16bit_by`` (the loss scale they still carried)."""
        for part in self.parts:
            part.relink_grads(divide_16bit_by)

    @property
    def plain_grads(self) -> bool:
        """Each ``p.grad`` is its parameter's whole gradient and this rank holds every
        parameter (stage 0, no expert part): torch's own clipping of ``p.grad`` is global.
        Under ep a rank holds only its experts' gradients, so a local norm would differ
        between ep ranks."""
        return self.stage == 0 and self.experts is None

    def step(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        """One optimizer over every part's masters: load every part's gradients x
        ``factor``, step once, write back and gather every part."""
        self.wait_params()  # the step writes this rank's chunks, which the gathers read
        for g in self.flat_groups:
            g.load_master_grads(factor)
        optimizer.step()
        for g in self.flat_groups:
            g.release_master_grads()
            g.copy_master_to_params()
        for part in self.parts:
            part.gather_updated_params()

    def after_step(self) -> None:
        """Clear the gradients and open a fresh window (after a step, or ``zero_grad``)."""
        for part in self.parts:
            part.after_step()
        self._divided_by = 1.0
        self.grads_ready = False

    def release_module(self, module: nn.Module) -> None:
        for part in self.parts:
            part.release_module(module)
        self.gatherer = None

    def reload_params(self) -> None:
        for part in self.parts:
            part.reload_params()

    @contextmanager
    def no_sync(self):
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.no_sync())
            yield

    def gathered(self, module: nn.Module | None = None):
        """Whole parameters of ``module`` (default: all) inside the block; every rank must
        enter it. Changes made inside are not kept under stage 3."""
        self.wait_params()
        return nullcontext() if self.gatherer is None else self.gatherer.gathered(module)

    # accounting ---------------------------------------------------------------------------
    @property
    def trainable_numel(self) -> int:
        return sum(part.trainable_numel for part in self.parts)

    @property
    def frozen_sharded_numel(self) -> int:
        return sum(part.frozen_sharded_numel for part in self.parts)

    def comm_bytes_theory(self, micro_steps: int = 1, gathers: int | None = None) -> int:
        """Bytes one optimizer step with ``micro_steps`` micro-steps records (the plan
        table); ``gathers``: stage 3 under a pipeline, the all-gathers per unit this step.
        With an expert part: both parts' (the expert part's recorded under ``edp``; a part
        whose group is one rank records nothing)."""
        if self.experts is None:
            return self.dense.comm_bytes_theory(micro_steps, gathers)
        return sum(self.comm_bytes_by_group(micro_steps).values())

    def comm_bytes_by_group(self, micro_steps: int = 1) -> dict[str, int]:
        """The plan's bytes per ledger group name: the replicas' (``dp``/``dp_cp``) and
        ``edp``'s; a group of one rank records nothing."""
        out: dict[str, int] = {}
        for part in self.parts:
            if part.replicas.size > 1:
                name = part.replicas.name
                out[name] = out.get(name, 0) + part.comm_bytes_theory(micro_steps)
        return out

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters (device / host), gradients and fp32 masters."""
        out = {"params": 0, "params_host": 0, "grads": 0, "master": 0}
        for part in self.parts:
            for k, v in part.state_bytes().items():
                out[k] += v
        return out
