"""Expert and non-expert parameters under one ZeRO lifecycle: two ``ZeroStage``\\s, one face.

With expert parallelism (``mesh.expert_parallel_size`` = ``ep`` > 1) a rank holds two kinds
of trainable parameters (``meshtrain.parallel.experts.is_expert_param``):

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
one ``predivide`` (the Engine folds them into one backward multiplier and one scaling
pass), and the Engine stays ignorant of experts.

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

from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from meshtrain.distributed.topology import Topology
from meshtrain.errors import ConfigError
from meshtrain.parallel.experts import is_expert_param
from meshtrain.parallel.zero.stage import ZeroStage


def build_zero(model: nn.Module, groups: list[dict], config, topology: Topology):
    """The ZeRO stage for ``groups``: one ``ZeroStage`` over the replicas, or, when
    ``ep > 1`` and some trainable parameters are experts, ``ZeroStages`` (module docstring)."""
    # frozen experts count too: under ZeRO-3 they are sharded over edp, never over dp
    has_experts = any(is_expert_param(p) for p in model.parameters())
    if topology.ep_size == 1 or not has_experts:
        return ZeroStage(model, groups, config, topology)
    return ZeroStages(model, groups, config, topology)


def _split(groups: list[dict], expert: bool) -> tuple[list[dict], list[int]]:
    """The groups restricted to one kind, the empty ones dropped, and their indices."""
    kept, index = [], []
    for i, g in enumerate(groups):
        params = [p for p in g["params"] if is_expert_param(p) == expert]
        if params:
            kept.append({**g, "params": params})
            index.append(i)
    return kept, index


class _Gatherers:
    """Stage 3: both parts' ``ParamGatherer``\\s behind the calls made from outside."""

    def __init__(self, gatherers) -> None:
        self.gatherers = gatherers

    @contextmanager
    def gathered(self, module: nn.Module | None = None):
        with ExitStack() as stack:
            for g in self.gatherers:
                stack.enter_context(g.gathered(module))
            yield

    @contextmanager
    def paused(self):
        with ExitStack() as stack:
            for g in self.gatherers:
                stack.enter_context(g.paused())
            yield

    def release_all(self) -> None:
        for g in self.gatherers:
            g.release_all()

    def gathered_bytes(self) -> int:
        return sum(g.gathered_bytes() for g in self.gatherers)

    def remove(self) -> None:
        for g in self.gatherers:
            g.remove()


class ZeroStages:
    """A ``ZeroStage`` for the non-expert parameters (over ``topology.replica_group``) and
    one for the expert parameters (over ``edp``, divided by dp x cp), with
    ``ZeroStage``'s lifecycle and accounting, so the Engine, the Trainer and the
    Accelerator call one object (module docstring)."""

    def __init__(self, model: nn.Module, groups: list[dict], config, topology: Topology) -> None:
        self.stage = int(config.zero_optimization.stage)
        self.topology = topology
        dense, self._dense_index = _split(groups, expert=False)
        experts, self._expert_index = _split(groups, expert=True)
        replicas = topology.replica_group
        self.parts: list[ZeroStage] = []
        self.dense = None
        if dense:
            self.dense = ZeroStage(
                model,
                dense,
                config,
                topology,
                replicas,
                frozen_select=lambda p: not is_expert_param(p),
            )
            self.parts.append(self.dense)
        self.experts = ZeroStage(
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
        self.parts.append(self.experts)
        self.every_backward = self.experts.every_backward
        self.predivide = self.experts.predivide
        self.grad_divisor = self.experts.grad_divisor
        assert self.dense is None or self.dense.grad_divisor == self.grad_divisor
        per_group: list[list] = [[] for _ in groups]
        for part, index in ((self.dense, self._dense_index), (self.experts, self._expert_index)):
            if part is not None:
                for i, fgs in zip(index, part.per_group, strict=True):
                    per_group[i].extend(fgs)
        self.per_group = per_group
        found = [p.gatherer for p in self.parts if p.gatherer is not None]
        self.gatherer = _Gatherers(found) if found else None

    # the flat groups of both parts -------------------------------------------------------
    @property
    def flat_groups(self):
        return [fg for part in self.parts for fg in part.flat_groups]

    @property
    def frozen_groups(self):
        return [fg for part in self.parts for fg in part.frozen_groups]

    # the lifecycle: every part, in a fixed order ------------------------------------------
    def wait_params(self) -> None:
        for part in self.parts:
            part.wait_params()

    def begin_window(self) -> None:
        for part in self.parts:
            part.begin_window()

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
        # an expert's gradient already sums the tokens of its whole ep group (the
        # all-to-all), so "this rank's own gradient" has no meaning for it
        raise ConfigError(
            "optimizer.step() after backward passes all inside no_sync (local SGD): under "
            "expert parallelism an expert's gradient holds its ep group's tokens, not this "
            "rank's; set mesh.expert_parallel_size to 1, or step after a synchronising backward"
        )

    @property
    def synchronising(self) -> bool:
        return all(part.synchronising for part in self.parts)

    @property
    def window_reduced(self) -> bool:
        return any(part.window_reduced for part in self.parts)

    def finish_window_reduction(self) -> None:
        for part in self.parts:
            part.finish_window_reduction()

    def grad_square_sum(self) -> torch.Tensor:
        return sum(part.grad_square_sum() for part in self.parts)

    def grad_norm(self) -> float:
        """L2 norm over both kinds (module docstring: expert squares summed over ep)."""
        return float(self.grad_square_sum().sqrt())

    def step(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        """One optimizer over both parts' masters: load every part's gradients, step once,
        write back and gather every part."""
        self.wait_params()
        for g in self.flat_groups:
            g.load_master_grads(factor)
        optimizer.step()
        for g in self.flat_groups:
            g.release_master_grads()
            g.copy_master_to_params()
        for part in self.parts:
            part._gather_updated_params()

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

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
        self.wait_params()
        return ExitStack() if self.gatherer is None else self.gatherer.gathered(module)

    # accounting ---------------------------------------------------------------------------
    @property
    def trainable_numel(self) -> int:
        return sum(part.trainable_numel for part in self.parts)

    @property
    def frozen_sharded_numel(self) -> int:
        return sum(part.frozen_sharded_numel for part in self.parts)

    def comm_bytes_theory(self, micro_steps: int = 1) -> int:
        """Bytes of both parts (the expert part's recorded under ``edp``; a part whose
        group is one rank records nothing)."""
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
        out = {"params": 0, "params_host": 0, "grads": 0, "master": 0}
        for part in self.parts:
            for k, v in part.state_bytes().items():
                out[k] += v
        return out
