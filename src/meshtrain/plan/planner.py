"""The search: every layout meshtrain runs for a model on N devices, each predicted.

``Planner(facts, hw, gpus=N, ...)`` enumerates (``layouts``) every factorisation
``pp x dp x cp x tp = N`` (tp within a node, cp up to 16, pp up to the block count), ep
dividing ``dp x cp`` and the expert count, ZeRO stage 0-3 with the offloads each stage
takes, sequence parallelism, the six pipeline schedules (interleaved, zbv and dualpipev
with two chunks per rank), both context-parallel methods, micro-batches of 1, 2, 4, ...
dividing the batch per replica, activation checkpointing on and off, and packed rows: with
``padding`` (the padded share of unpacked rows) each layout packed and not, the packed one
paying its masks' memory and the padded one counting only its data tokens. Each structure (everything but the
micro-batch and checkpointing, which no check refuses) goes once through
``validity.LayoutCheck``: what it refuses is dropped and counted. ``ranked`` predicts the
rest (``memory.predict_memory``, ``step_time.predict_time``) and sorts the ones that fit
first, fastest first.
"""

from __future__ import annotations

from collections import Counter

from meshtrain.errors import ConfigError
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.host_memory import LOADINGS, predict_host_load
from meshtrain.plan.layout import Layout
from meshtrain.plan.memory import predict_memory, rank_params, zero3_units
from meshtrain.plan.model_facts import ModelFacts
from meshtrain.plan.prediction import Prediction
from meshtrain.plan.step_time import predict_time, step_flops_per_token
from meshtrain.plan.validity import LayoutCheck

__all__ = ["Planner"]

SCHEDULES = (
    ("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2),
)  # fmt: skip
MAX_CP = 16


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Planner:
    """Layouts of one model on ``gpus`` devices of kind ``hw`` (module docstring)."""

    def __init__(
        self,
        facts: ModelFacts,
        hw: Hardware,
        *,
        gpus: int,
        seq: int,
        global_batch: int,
        limit: int,
        precision: str = "bf16",
        optimizer: str = "AdamW",
        micro_batches: tuple[int, ...] = (1, 2, 4, 8),
        packed: bool = False,
        padding: float | None = None,
        loading: str = "whole",
    ) -> None:
        if gpus < 1:
            raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
        if seq < 1 or global_batch < 1:
            raise ConfigError("--seq and --global-batch: must be >= 1")
        if padding is not None and not 0.0 <= padding < 1.0:
            raise ConfigError(
                f"--padding: the share of padded slots in unpacked rows, 0 <= F < 1, got {padding}"
            )
        if packed and padding is not None:
            raise ConfigError(
                "--packed and --padding: give one (--packed: the rows are packed; --padding F: "
                "search packed and padded rows, F the padded share of unpacked rows)"
            )
        if loading not in LOADINGS:
            raise ConfigError(f"--loading: {loading!r}; one of {', '.join(LOADINGS)}")
        if loading == "sliced" and facts.family == "decoder":
            raise ConfigError(
                "--loading sliced: only transformers models load sliced "
                "(meshtrain.from_pretrained(folder, config=...)); build a meshtrain Decoder "
                "under meshtrain.zero.Init (--loading zero-init) or whole (--loading whole)"
            )
        self.loading = loading
        # packed rows: every layout with them, or (padding given) each layout both ways
        self.packings = (False, True) if padding is not None else (packed,)
        self.padding = padding or 0.0
        self.facts, self.hw, self.gpus, self.seq = facts, hw, gpus, seq
        self.global_batch, self.limit = global_batch, limit
        self.precision, self.optimizer = precision, optimizer
        self.micro_batches = micro_batches
        self.check = LayoutCheck(facts, seq, precision)
        self.refused: Counter[str] = Counter()
        self._refusals: dict[Layout, str | None] = {}
        self._states: dict = {}  # model states per (tp, pp, ep, dp, stage, ...)
        self._trainable: dict[tuple[int, int, int], int] = {}

    # -- the search space --------------------------------------------------------------
    def structures(self):
        """Every layout with micro-batch 1 and no checkpointing (module docstring)."""
        f, n = self.facts, self.gpus
        for tp in _divisors(n):
            if tp > self.hw.gpus_per_node or tp > f.heads:
                continue
            for cp in _divisors(n // tp):
                if cp > MAX_CP:
                    continue
                for pp in _divisors(n // (tp * cp)):
                    if pp > f.layers:
                        continue
                    dp = n // (tp * cp * pp)
                    eps = [e for e in _divisors(dp * cp) if f.moe and f.n_experts % e == 0]
                    for ep in eps or [1]:
                        yield from self._knobs(Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep))

    def _knobs(self, base: Layout):
        stages = (0, 1, 2) if base.pp > 1 else (0, 1, 2, 3)
        offloads = {0: [(False, False)], 1: [(False, False), (True, False)],
                    2: [(False, False), (True, False)],
                    3: [(False, False), (True, False), (True, True)]}  # fmt: skip
        sps = (False, True) if base.tp > 1 else (False,)
        schedules = SCHEDULES if base.pp > 1 else (("1f1b", 1),)
        methods = ("ring", "all_to_all") if base.cp > 1 else ("ring",)
        for stage in stages:
            for off_o, off_p in offloads[stage]:
                for sp in sps:
                    for sched, v in schedules:
                        if v > 1 and base.pp * v > self.facts.layers:
                            continue
                        for method in methods:
                            yield base.but(
                                stage=stage, offload_optimizer=off_o, offload_param=off_p,
                                sequence_parallel=sp, schedule=sched, virtual_stages=v,
                                cp_method=method,
                            )  # fmt: skip

    def layouts(self):
        """Every layout meshtrain accepts (module docstring)."""
        for base in self.structures():
            per_replica, rem = divmod(self.global_batch, base.dp)
            if rem or per_replica == 0:
                self.refused[f"--global-batch {self.global_batch} not divisible by dp"] += 1
                continue
            for mb in self.micro_batches:
                if per_replica % mb:
                    continue
                for packed in self.packings:
                    layout = base.but(micro_batch=mb, grad_accum=per_replica // mb, packed=packed)
                    why = self.refusal(layout)
                    if (
                        why is None
                        and layout.schedule == "dualpipev"
                        and layout.grad_accum < 2 * layout.pp
                    ):
                        # the one refusal that depends on the accumulation (build_schedule's)
                        why = "pipeline.schedule dualpipev needs gradient_accumulation_steps >= 2 x pp"
                    if why is not None:
                        self.refused[why] += 1
                        continue
                    yield layout
                    yield layout.but(checkpointing=True)

    def refusal(self, layout: Layout) -> str | None:
        """``LayoutCheck.refusal`` (the engine's), once per structure, and the one layout
        meshtrain runs that the planner does not model (ZeRO-3 under a pipeline, never
        enumerated either): the micro-batch, the accumulation
        and checkpointing refuse nothing by themselves; the schedule's action lists for
        this micro-batch count are built (and checked) when the time model asks."""
        if self.loading == "zero-init" and layout.stage != 3:
            return (
                f"zero_optimization.stage {layout.stage} with --loading zero-init: "
                "meshtrain.zero.Init partitions the parameters as they are built, which is "
                "ZeRO stage 3; plan another stage with --loading whole"
            )
        if layout.pp > 1 and layout.stage >= 3:  # the planner's own limit, not the engine's
            return (
                "zero_optimization.stage 3 with mesh.pipeline_parallel_size > 1 is not "
                "planned: meshtrain runs it, but a stage's parameters stay whole for its run "
                "of the schedule, which the planner's memory model does not count; plan "
                "stage 1 or 2 under the pipeline"
            )
        key = layout.but(micro_batch=1, grad_accum=1, checkpointing=False)
        if key not in self._refusals:
            self._refusals[key] = self.check.refusal(key)
        return self._refusals[key]

    # -- predictions -------------------------------------------------------------------
    def predict(self, layout: Layout) -> Prediction:
        """Memory and step time of one layout."""
        common = dict(seq=self.seq, precision=self.precision, optimizer=self.optimizer)
        memory = predict_memory(
            self.facts, layout, self.check, self.hw, cache=self._states, **common
        )
        # the largest rank's trainable parameters before ZeRO: what its reductions move
        if layout.pp == 1:
            trainable = self._local_trainable(layout)
        else:
            share = self._local_trainable(layout.but(pp=1)) / max(1, self.facts.params)
            trainable = round(
                max(r[0] for r in rank_params(self.facts, layout, self.check)) * share
            )
        units = None
        if layout.stage == 3:  # kept whole (dense, experts): the gathers move only the units
            key = ("zero3", layout.tp, layout.ep)
            if key not in self._states:
                whole, _, expert_whole = zero3_units(self.facts, layout.tp, layout.ep)
                self._states[key] = (whole - expert_whole, expert_whole)
            units = self._states[key]
        time = predict_time(
            self.facts, layout, self.check, self.hw, trainable_per_rank=trainable,
            zero3_whole=units or (0, 0), experts_per_rank=self._local_experts(layout), **common,
        )  # fmt: skip
        host = predict_host_load(
            self.facts, layout, self.check, self.hw, precision=self.precision,
            optimizer=self.optimizer, cache=self._states, loading=self.loading,
        )  # fmt: skip
        return Prediction(
            layout, memory, time, self.seq, step_flops_per_token(self.facts, self.seq),
            self.hw.peak_flops, self.limit, host, 0.0 if layout.packed else self.padding,
        )  # fmt: skip

    def _local_trainable(self, layout: Layout) -> int:
        """Trainable parameters on one rank before ZeRO (tp and ep applied)."""
        from meshtrain.estimate.model_states import model_states_bytes

        key = (layout.tp, layout.ep, layout.dp * layout.cp)
        if key in self._trainable:
            return self._trainable[key]
        s = model_states_bytes(
            self.facts.model, dp=layout.dp * layout.cp, stage=0, precision="fp32",
            optimizer=0, tp=layout.tp, ep=layout.ep,
        )  # fmt: skip
        self._trainable[key] = s.grads // 4
        return self._trainable[key]

    def _local_experts(self, layout: Layout) -> int:
        """The largest rank's expert parameters under ep: its ``1/ep`` of the experts of the
        blocks it holds (experts are not split over tp; a pipeline rank holds the experts
        of its blocks, every MoE block the same size)."""
        if layout.ep == 1 or not self.facts.moe:
            return 0
        share = 1.0
        if layout.pp > 1:
            blocks = max(r[2] for r in rank_params(self.facts, layout, self.check))
            share = blocks / self.facts.layers
        return round(self.facts.expert_params * share) // layout.ep

    def ranked(self) -> list[Prediction]:
        """Every accepted layout predicted: those that fit first, then by step time."""
        preds = [self.predict(x) for x in self.layouts()]
        preds.sort(key=lambda p: (not p.fits, -p.tokens_per_s, p.memory.total))
        return preds
