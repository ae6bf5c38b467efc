"""Which layouts meshtrain runs: the planner asks the engine's own checks, never a copy.

For each candidate the layout's config goes through ``load_config`` for the world size
and ``Config.resolve_batch_sizes`` for its dp (what ``initialize`` and the engine's start
do: every section's validation and the batch arithmetic), its sizes through ``MeshLayout.for_world`` (the mesh arithmetic), and then
through the checks ``parallelize`` runs before it changes a model, on the meta-device
model with a stand-in topology that has the sizes and no process groups:

* ``parallel.experts.shard.check_layout`` (MoE under cp) and, for ep > 1,
  ``expert_modules`` with each layer's expert count (ep must divide it);
* ``parallel.pipeline.engine_step.check_pipeline`` (sequence parallelism with a
  PipelineModule or of a family that cannot send shards, MoE models a pipeline cannot
  cut);
* ``parallel.context.apply.check_context_parallel`` (families with cp attention);
* tensor parallelism: a built-in plan for the model's class
  (``parallel.tensor.plans.plan_for``) that supports sequence parallelism when asked;
* the pipeline split (``split_model``: at most one stage per block) and the schedule's
  action lists (``build_schedule``);
* packed rows: ``models.packed_batches.check_packed_batch`` (the engine's check of every
  packed batch: the family keeps documents apart, the attention gets the mask);
* the data the layout needs: the sequence a multiple of ``2 cp`` (the chunks context
  parallelism cuts) and of ``tp`` under sequence parallelism (the engine refuses others at
  the first batch).

What these checks refuse is what ``meshtrain.initialize`` refuses, so a layout the
planner proposes is one the engine builds (``tests/plan`` initializes the winners).
"""

from __future__ import annotations

from types import SimpleNamespace

from meshtrain.errors import MeshtrainError
from meshtrain.plan.layout import Layout
from meshtrain.plan.model_facts import ModelFacts

__all__ = ["LayoutCheck"]

WALK_LIMIT = 4096  # p x m x v up to which the action lists are built and walked


class LayoutCheck:
    """The engine's refusals for one model and sequence length (module docstring); holds
    the pipeline splits and schedules it built, which the memory and time models reuse."""

    def __init__(self, facts: ModelFacts, seq: int, precision: str = "bf16") -> None:
        self.facts, self.seq, self.precision = facts, seq, precision
        self._splits: dict[int, list] = {}
        self._schedules: dict[tuple, object] = {}
        self._ranks: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        self._model_checks: dict[tuple, Exception | None] = {}
        self._experts: list[tuple[str, int]] | None = None

    def refusal(self, layout: Layout) -> str | None:
        """Why meshtrain refuses ``layout``, else None."""
        try:
            self._check(layout)
        except (MeshtrainError, ValueError) as exc:
            return str(exc).splitlines()[0]
        return None

    def split(self, stages: int) -> list:
        """``split_model`` of the meta model into ``stages`` (cached)."""
        from meshtrain.parallel.pipeline.split import split_model

        if stages not in self._splits:
            self._splits[stages] = split_model(self.facts.model, stages)
        return self._splits[stages]

    def rank_params(
        self, pp: int, v: int = 1, schedule: str = "1f1b"
    ) -> list[tuple[int, int, int]]:
        """Per pp rank: (trainable, frozen, blocks) of its stages, the model cut into
        ``pp x v`` stages as the engine cuts it (stage ``k`` on rank ``k % pp``, or in a
        V for zbv / dualpipev: ``schedules.stage_rank``)."""
        from meshtrain.parallel.pipeline.schedules import V_SHAPED, stage_rank

        place = schedule if schedule in V_SHAPED else "1f1b"
        key = (pp, v, place)
        if key not in self._ranks:
            stages = self.split(pp * v)
            out = []
            for r in range(pp):
                mine = [st for k, st in enumerate(stages) if stage_rank(place, k, pp) == r]
                params = {id(p): p for st in mine for p in st.names.values()}
                trainable = sum(p.numel() for p in params.values() if p.requires_grad)
                frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
                blocks = sum(len(getattr(st, "block_ids", ())) for st in mine)
                out.append((trainable, frozen, blocks))
            self._ranks[key] = out
        return self._ranks[key]

    def walks(self, p: int, m: int, v: int) -> bool:
        """Whether the schedule is small enough to build and walk: its action lists cost
        time quadratic in their length, so a search over thousands of devices uses the
        closed forms of ``pipeline.validate`` and ``estimate.pipeline`` beyond this size
        (they equal the walked figures for the costs used here)."""
        return p * m * v <= WALK_LIMIT

    def bubble(self, name: str, p: int, m: int, v: int) -> float:
        """The schedule's idle fraction: its action lists' (``idle_fraction``) when
        ``walks``, else the closed form (``expected_idle_fraction``)."""
        from meshtrain.parallel.pipeline.validate import expected_idle_fraction, idle_fraction

        if self.walks(p, m, v):
            return float(idle_fraction(self.schedule(name, p, m, v)))
        return float(expected_idle_fraction(name, p, m, v))

    def schedule(self, name: str, p: int, m: int, v: int):
        """``build_schedule`` with a backward twice a forward (zb_h1, zbv, dualpipev: B and W
        one each)."""
        from meshtrain.parallel.pipeline.schedules import SPLIT_BACKWARD, B, F, W, build_schedule

        key = (name, p, m, v)
        if key not in self._schedules:
            costs = {F: 1, B: 1, W: 1} if name in SPLIT_BACKWARD else {F: 1, B: 2}
            self._schedules[key] = build_schedule(name, p, m, v, costs)
        return self._schedules[key]

    def _check(self, layout: Layout) -> None:
        from meshtrain.config import Config, load_config
        from meshtrain.distributed.topology import MeshLayout
        from meshtrain.errors import ConfigError

        seq = self.seq
        written = layout.config(self.precision)
        load_config(written, world_size=layout.world)  # what initialize loads first
        config = Config.from_dict(written)
        config.resolve_batch_sizes(layout.dp)  # what the engine resolves on its mesh
        MeshLayout.for_world(layout.world, pp=layout.pp, tp=layout.tp, cp=layout.cp, ep=layout.ep)
        # the checks that walk the model read the sizes (their messages name them), the
        # stage, sequence parallelism and packed rows, not the batch: once per such shape
        shape = (layout.pp, layout.tp, layout.cp, layout.ep, layout.dp,
                 layout.sequence_parallel, layout.stage, layout.packed)  # fmt: skip
        if shape not in self._model_checks:
            try:
                self._model_check(layout, config)
                self._model_checks[shape] = None
            except ConfigError as exc:
                self._model_checks[shape] = exc
        if self._model_checks[shape] is not None:
            raise self._model_checks[shape]
        if layout.ep > 1:
            for name, n_experts in self._expert_counts():
                if n_experts % layout.ep:
                    raise ConfigError(
                        f"mesh.expert_parallel_size: {layout.ep} does not divide the "
                        f"{n_experts} experts of {name}; pick an ep that divides the expert count"
                    )
        if layout.pp > 1:
            self.split(layout.pp * layout.virtual_stages)
            if self.walks(layout.pp, layout.grad_accum, layout.virtual_stages):
                self.schedule(layout.schedule, layout.pp, layout.grad_accum, layout.virtual_stages)
        if layout.cp > 1 and seq % (2 * layout.cp):
            raise ConfigError(
                f"--seq: {seq} is not a multiple of 2 x cp = {2 * layout.cp} (the chunks "
                "context parallelism cuts)"
            )
        if layout.sequence_parallel and seq % layout.tp:
            raise ConfigError(
                f"--seq: {seq} is not a multiple of tp {layout.tp} (sequence parallelism)"
            )

    def _expert_counts(self) -> list[tuple[str, int]]:
        from meshtrain.parallel.experts.shard import expert_modules

        if self._experts is None:
            self._experts = [(n, m.num_experts) for n, m in expert_modules(self.facts.model)]
        return self._experts

    def _model_check(self, layout: Layout, config) -> None:
        """The checks ``parallelize`` runs on the model, with a stand-in topology."""
        from meshtrain.errors import ConfigError
        from meshtrain.parallel.experts.shard import check_layout

        topology = SimpleNamespace(
            pp_size=layout.pp, dp_size=layout.dp, cp_size=layout.cp, tp_size=layout.tp,
            ep_size=layout.ep,
        )  # fmt: skip
        model = self.facts.model
        check_layout(model, topology)
        if layout.packed:  # the engine's check of every packed batch, on a packed stand-in
            import torch

            from meshtrain.models.packed_batches import check_packed_batch

            check_packed_batch(model, {"position_ids": torch.tensor([[0, 1, 0, 1]])})
        if layout.ep > 1 and not self._expert_counts():
            raise ConfigError("mesh.expert_parallel_size: the model has no MoE layer")
        if layout.pp > 1:
            from meshtrain.parallel.pipeline.engine_step import check_pipeline

            check_pipeline(model, topology, config)
        if layout.cp > 1:
            from meshtrain.parallel.context.apply import check_context_parallel

            check_context_parallel(model, topology, config)
        if layout.tp > 1:
            from meshtrain.parallel.tensor.plans import plan_for

            plan = plan_for(model)
            if plan is None:
                raise ConfigError(
                    f"mesh.tensor_parallel_size: {type(model).__name__} has no built-in "
                    "tensor-parallel plan"
                )
            if layout.sequence_parallel and not plan.sequence_parallel:
                raise ConfigError(
                    "tensor_parallel.sequence_parallel: the model's plan does not support it"
                )
