"""``engine.memory_report()``: the model-state bytes this rank holds, beside the formula.

Measured, from the tensors the engine owns: ``params`` (the flat parameter buffer, or the
ZeRO-3 shards of trainable and frozen parameters plus any unit gathered right now, plus
frozen parameters kept whole), ``grads`` (the
flat gradient buffer or shard), ``optimizer`` (separate fp32 masters plus every tensor in
the optimizer's state), with what offload put in host memory moved to ``host``. The
formula is ``meshtrain.estimate.model_states_bytes`` for the same trainable/frozen
counts, stage, data-parallel size, precision and optimizer: the ZeRO paper's per-rank
model states. They differ by padding (each bucket rounded up to a multiple of ``N``), by
the optimizer's scalar ``step`` tensors, by stage 3's gathered units, and, under stage 3,
by frozen parameters kept whole (under the persistence threshold or outside every unit).
Frozen parameters enter the formula by their bytes, at the dtype they are held in (a
bf16 base left bf16 in an fp32 run, quantized codes), not at the run's width.

With pipeline parallelism the flat groups hold this rank's stages only, so measured and
formula are this pp rank's (its ``Psi_r``), and ``pipeline`` adds its stages, the
micro-batches alive at the schedule's peak (from the action list) and, for a split
transformer, the activation bytes at that peak by ``meshtrain.estimate.pipeline``'s
formula at the model's longest sequence (an estimate, not a measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.engine.engine_view import EngineView
from meshtrain.estimate.model_states import ModelStates, model_states_bytes

_OPTIMIZER_NAMES = {
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "adafactor": "Adafactor",
    "adamw8bit": "AdamW8bit",
    "lion32bit": "Lion",
    "lion8bit": "Lion8bit",
}


# an 8-bit optimizer's parameters marked ``meshtrain_optim_bits = 32`` (the Trainer's
# ``optim.keep_embeddings_32bit``, as transformers' Trainer does) hold this one's state
_FULL_WIDTH = {"AdamW8bit": "AdamW", "Lion8bit": "Lion"}


def _full_width_numel(zero) -> int:
    """Trainable elements whose optimizer state is kept at 32 bits (``meshtrain_optim_bits``)."""
    return sum(
        g.shapes[p].numel()
        for g in zero.flat_groups
        for p in g.params
        if getattr(p, "meshtrain_optim_bits", None) == 32
    )


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str | None:
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return "SGD-momentum" if momentum else "SGD"
    return _OPTIMIZER_NAMES.get(name)


@dataclass(frozen=True)
class PipelinePart:
    """This pp rank's share of the pipeline: which stages, and activations at the peak."""

    pp: int
    pp_rank: int
    stages: tuple[int, ...]
    schedule: str
    micro_batches: int  # m per step (gradient_accumulation_steps)
    peak_micro_batches: int  # (chunk) activations alive at once at the peak
    activations: int | None  # bytes at the peak (formula); None when unknown
    seq_len: int | None = None  # the sequence length the activation formula assumed

    def __str__(self) -> str:
        acts = (
            f"activations ~{self.activations / 2**20:.2f} MiB at {self.seq_len} tokens (formula)"
            if self.activations is not None
            else "activations: no formula for this model"
        )
        return (
            f"pipeline: pp rank {self.pp_rank} of {self.pp}, stages {list(self.stages)}, "
            f"{self.schedule}, m={self.micro_batches}: peak {self.peak_micro_batches} "
            f"micro-batches alive; {acts}"
        )


@dataclass(frozen=True)
class MemoryReport:
    """This rank's model-state bytes (``measured``) and the formula's (``formula``)."""

    measured: ModelStates
    formula: ModelStates | None
    stage: int
    dp: int
    precision: str
    optimizer: str | None
    tp: int = 1  # tensor-parallel size: measured and formula are this rank's shard
    pipeline: PipelinePart | None = None  # pp > 1: this rank's stages and activations

    @property
    def ratio(self) -> float | None:
        """measured / formula, device and host bytes together."""
        if self.formula is None:
            return None
        want = self.formula.total + self.formula.host
        return (self.measured.total + self.measured.host) / max(want, 1)

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:10.2f}"

        f = self.formula
        rows = [
            f"model states per rank (ZeRO stage {self.stage}, dp {self.dp}, "
            + (f"tp {self.tp}, " if self.tp > 1 else "")
            + f"{self.precision}, {self.optimizer or 'unknown optimizer'}), MiB",
            f"{'':12}{'measured':>10} {'formula':>10}",
        ]
        for key in ("params", "grads", "optimizer", "host"):
            formula = mib(getattr(f, key)) if f else f"{'-':>10}"
            rows.append(f"{key:12}{mib(getattr(self.measured, key))} {formula}")
        total_f = mib(f.total + f.host) if f else f"{'-':>10}"
        rows.append(f"{'total':12}{mib(self.measured.total + self.measured.host)} {total_f}")
        if self.ratio is not None:
            rows.append(f"measured / formula = {self.ratio:.4f}")
        if self.pipeline is not None:
            rows.append(str(self.pipeline))
        return "\n".join(rows)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_report(engine: EngineView) -> MemoryReport:
    """Build the report for ``engine`` (see module docstring)."""
    zero = engine.zero
    in_groups = {id(p) for g in [*zero.flat_groups, *zero.frozen_groups] for p in g.params}
    frozen = {id(p): p for p in engine.module.parameters() if id(p) not in in_groups}
    # the formula counts a frozen parameter at the run's width; one held in another dtype
    # (a bf16 base in an fp32 run, 4-bit or 8-bit codes) is counted by its bytes instead
    width = 4 if str(engine.config.precision).lower() == "fp32" else 2
    frozen_bytes = sum(g.frozen_numel * g.itemsize for g in zero.frozen_groups)
    frozen_bytes += sum(_tensor_bytes(p) for p in frozen.values())
    frozen_numel = -(-frozen_bytes // width)
    trainable = zero.trainable_numel
    z = engine.config.zero_optimization
    offload_opt = z.offload_optimizer is not None and z.offload_optimizer.device == "cpu"
    offload_par = z.offload_param is not None and z.offload_param.device == "cpu"
    b = zero.state_bytes()
    params = b["params"] + sum(_tensor_bytes(p) for p in frozen.values())
    host, grads, masters = b["params_host"], b["grads"], b["master"]
    # once per tensor: bitsandbytes shares one quantization map (qmap) among its states
    unique = {
        (t.data_ptr(), t.numel()): t
        for s in engine.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.numel()
    }
    states = sum(_tensor_bytes(t) for t in unique.values())
    optimizer = masters + states
    if offload_opt:
        host, optimizer = host + optimizer, 0
    measured = ModelStates(params=params, grads=grads, optimizer=optimizer, host=host)

    name = _optimizer_name(engine.optimizer)
    formula = None
    if name is not None and trainable:
        common = dict(
            stage=engine.zero_stage,
            precision=engine.config.precision,
            optimizer=name,
            offload_optimizer=offload_opt,
            offload_param=offload_par,
        )
        if zero.experts is None:  # one part, over the replicas
            dp = engine.topology.dp_size
            wide = _full_width_numel(zero) if name in _FULL_WIDTH else 0
            formula = model_states_bytes(
                trainable - wide, dp=dp, frozen_params=frozen_numel, **common
            )
            if wide:  # embeddings with 32-bit state under an 8-bit optimizer (Trainer)
                wide_common = {**common, "optimizer": _FULL_WIDTH[name]}
                formula = formula + model_states_bytes(wide, dp=dp, **wide_common)
        else:  # expert parallelism: each kind over its own replicas (parallel.zero.stage)
            formula = _expert_formula(zero, frozen, common)
    # Under tensor parallelism the flat groups hold this rank's shards (sharded weights
    # / tp, replicated norms whole), so the formula over the same local counts is exact.
    return MemoryReport(
        measured,
        formula,
        engine.zero_stage,
        engine.topology.dp_size,
        engine.config.precision,
        name,
        tp=engine.topology.tp_size,
        pipeline=_pipeline_part(engine) if engine.pipeline is not None else None,
    )


def _expert_formula(zero, whole_frozen: dict, common: dict) -> ModelStates:
    """The formula for each part of a ``ZeroStage`` with experts (this rank's local counts, its own
    data-parallel degree: replicas for the rest, edp for the experts), summed. A part with
    frozen parameters only (frozen experts) holds their bytes alone."""
    from meshtrain.parallel.experts import is_expert_param

    total = ModelStates(0, 0, 0, 0)
    for part in zero.parts:
        expert = part is zero.experts
        loose = sum(p.numel() for p in whole_frozen.values() if is_expert_param(p) == expert)
        frozen, n = part.frozen_sharded_numel + loose, part.replicas.size
        if part.trainable_numel:
            total += model_states_bytes(part.trainable_numel, dp=n, frozen_params=frozen, **common)
        else:
            width = 4 if common["precision"] == "fp32" else 2
            held = width * (-(-frozen // n) if common["stage"] >= 3 else frozen)
            total += (
                ModelStates(0, 0, 0, held)
                if common["offload_param"]
                else ModelStates(held, 0, 0, 0)
            )
    return total


def _pipeline_part(engine: EngineView) -> PipelinePart:
    from meshtrain.estimate.pipeline import TransformerDims, rank_activations

    pipe, cfg = engine.pipeline, engine.config
    mine = {int(k): st for k, st in engine.module.stages.items()}
    model = getattr(next(iter(mine.values())), "model", None)
    dims = TransformerDims.of(model) if model is not None else None
    peak, acts = rank_activations(
        mine, dims, schedule=pipe.schedule, pp=pipe.p, m=engine.gas, v=pipe.v,
        rank=engine.topology.pp_rank, b=cfg.train_micro_batch_size_per_gpu, seq_len=None,
        precision=cfg.precision, checkpointing=cfg.activation_checkpointing.enabled,
    )  # fmt: skip
    seq = dims.max_seq_len if dims is not None else None
    return PipelinePart(
        pipe.p, engine.topology.pp_rank, tuple(sorted(mine)), pipe.schedule, engine.gas,
        peak, acts, seq,
    )  # fmt: skip
