"""Per-device memory of one layout: model states, activations, communication buffers and
the framework's own overhead, the largest rank's (the one that decides whether it fits).

**Model states** are ``estimate.model_states_bytes`` exactly (the ZeRO paper's
formula), with one correction the engine makes: ZeRO-3 keeps parameters under
``stage3_param_persistence_threshold`` (100,000 elements) and those outside every unit
whole on every rank (``persistent_elements``; measured: this is the whole difference on
the decoder, to the byte but the optimizer's step scalars). ZeRO partitions over the
``dp x cp`` replicas (the engine's ``replica_group``), tensor parallelism through the
model's plan (``parallel.tensor.sizes``: norms whole, padding counted), experts over ep.
Under a pipeline each pp rank's parameters are those of its stages, the model cut as the
engine cuts it (``split_model`` on the meta device, ``estimate.pipeline``'s rule); under
pp x tp each rank's count is scaled by the plan's tp share of the whole model (approximate:
the share is the model's, not the stage's).

**Activations** per micro-batch of ``b`` sequences, ``s = L / cp`` tokens per rank: the
Llama-style formula of ``estimate.activations`` (measured within 0.1% on the Decoder),
its block split into norms, attention, MLP and small terms (``block_parts``). Tensor
parallelism divides attention, MLP and the heads' small terms by ``tp`` (column-parallel
outputs, row-parallel inputs), the norms only under sequence parallelism, and the loss's
``V`` columns by ``tp`` (vocab-parallel cross-entropy). A mixture-of-experts block keeps,
instead of the dense MLP, the router's fp32 logits ``4 E``, and for each of its ``k``
routed copies of a token the dispatched input ``w h``, the expert's gate, up, silu and
product ``4 w f_e`` and its output ``w h`` (derived the same way, not yet measured).
Packed rows (several documents a row) add their attention masks (``packed_masks``).
Activation checkpointing keeps each block's input ``w h`` (``/ tp`` under sequence
parallelism), and the peak adds the larger of the loss's two fp32 ``[b, s, V / tp]``
gradients (``peak_activation_bytes``, the start of the backward) and one block's full
activations while it is recomputed (later: the loss's gradients are gone by then; measured
on CPU, docs/plan.md). Without checkpointing the peak adds the loss's gradients. With the chunked loss
(``loss_chunk``: ``loss.chunked``'s chunk size ``C``) the forward keeps, instead of the
fp32 log-probabilities, the hidden states' gradient ``4 h`` per token and the head's fp32
gradient ``4 V h`` once (``loss.chunked_cross_entropy`` computes both in the forward), and
the transient is one chunk's fp32 logits and their gradient, ``2 x 4 C V``. Under a pipeline
the micro-batches alive at the peak come from the schedule's own action list
(``estimate.pipeline.peak_activations``); the loss lives on the last rank.

**Buffers**: stage 3 holds a gathered unit and its neighbour prefetched (the largest
sum of two adjacent units' sharded parameters, ``zero3_units``); a pipeline rank one received activation and one
gradient (``2 w b s h``); ring attention two key/value blocks in flight; expert
parallelism the dispatched and combined tokens (``2 w b s k h``). Stage 2's gradient
buckets add nothing measurable on CPU (their gradients are reduced into the shard as each
bucket fills), so none is counted.

**Overhead**: ``Hardware.overhead_bytes`` (data-sheet devices: an assumed 2 GiB for the
CUDA context, NCCL and the allocator's reserve; ``--calibrate`` measures it on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.estimate.activations import DecoderDims, block_parts
from meshtrain.estimate.model_states import ModelStates, model_states_bytes
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.layout import Layout
from meshtrain.plan.model_facts import ModelFacts
from meshtrain.plan.validity import LayoutCheck

__all__ = ["MemoryBreakdown", "predict_memory"]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the largest rank, by kind; ``host`` is what offload keeps in CPU memory."""

    states: ModelStates
    activations: int
    buffers: int
    overhead: int

    @property
    def total(self) -> int:
        return self.states.total + self.activations + self.buffers + self.overhead

    @property
    def tensors(self) -> int:
        """Peak tensor bytes: what the device holds without the framework's overhead."""
        return self.states.total + self.activations + self.buffers

    def parts(self) -> dict[str, int]:
        s = self.states
        return {
            "params": s.params,
            "grads": s.grads,
            "optimizer": s.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "overhead": self.overhead,
        }


def _width(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _dims(f: ModelFacts) -> DecoderDims:
    return DecoderDims(f.hidden, f.heads, f.kv_heads, f.ffn, f.vocab, f.layers)


def rank_params(
    facts: ModelFacts, layout: Layout, check: LayoutCheck
) -> list[tuple[int, int, int]]:
    """Per pp rank: (trainable, frozen, blocks) of its stages (the whole model at pp 1)."""
    if layout.pp == 1:
        return [(-1, -1, facts.layers)]
    return check.rank_params(layout.pp, layout.virtual_stages, layout.schedule)


def model_states(
    facts: ModelFacts,
    layout: Layout,
    check: LayoutCheck,
    precision: str,
    optimizer: str,
    cache: dict | None = None,
) -> list[ModelStates]:
    """Each pp rank's model states (module docstring); ``cache``: a dict kept between
    calls for one model (counting a tp plan's shares walks every module)."""
    key = (layout.tp, layout.pp, layout.virtual_stages, layout.ep, layout.dp * layout.cp,
           layout.stage, layout.offload_optimizer, layout.offload_param, precision, optimizer)  # fmt: skip
    if cache is not None and key in cache:
        return cache[key]
    out = _model_states(facts, layout, check, precision, optimizer)
    if cache is not None:
        cache[key] = out
    return out


def _model_states(
    facts: ModelFacts, layout: Layout, check: LayoutCheck, precision: str, optimizer: str
) -> list[ModelStates]:
    common = dict(
        dp=layout.dp * layout.cp,
        stage=layout.stage,
        precision=precision,
        optimizer=optimizer,
        offload_optimizer=layout.offload_optimizer,
        offload_param=layout.offload_param,
    )
    if layout.pp == 1:
        states = model_states_bytes(facts.model, tp=layout.tp, ep=layout.ep, **common)
        if layout.stage == 3 and not layout.offload_param:
            # kept whole instead of partitioned: dense over dp x cp, experts over their
            # replicas (dp x cp / ep)
            whole, _, experts = zero3_units(facts, layout.tp, layout.ep)
            n = layout.dp * layout.cp
            dense, n_e = whole - experts, max(1, n // layout.ep)
            extra = _width(precision) * (dense - -(-dense // n) + experts - -(-experts // n_e))
            states = ModelStates(states.params + extra, states.grads, states.optimizer, states.host)
        return [states]
    share = 1.0
    if layout.tp > 1:
        from meshtrain.parallel.tensor.sizes import local_parameter_counts

        local, _ = local_parameter_counts(facts.model, layout.tp)
        share = local / max(1, facts.params)
    out = []
    for trainable, frozen, _ in rank_params(facts, layout, check):
        n = max(1, round(trainable * share))
        expert = 0
        if layout.ep > 1 and facts.expert_params:
            expert = round(n * facts.expert_params / facts.params)
        out.append(
            model_states_bytes(
                n,
                frozen_params=round(frozen * share),
                ep=layout.ep,
                expert_params=expert,
                **common,
            )
        )
    return out


PERSISTENCE_THRESHOLD = 100_000  # zero_optimization.stage3_param_persistence_threshold's default


def zero3_units(facts: ModelFacts, tp: int = 1, ep: int = 1) -> tuple[int, list[int], int]:
    """ZeRO-3's view of the model: (trainable elements kept whole on every rank, sharded
    elements of each gather unit in order, the part of the kept-whole elements that are
    experts). Whole: parameters under ``stage3_param_persistence_threshold`` elements and
    those outside every unit (``parallel.zero.stage3.assign_units`` over
    ``parallel.blocks.gather_units``, on the meta model). The threshold is compared with
    a parameter's full size (``full_numel``) as the rank holds it: under ep an expert
    tensor is this rank's ``1 / ep`` of the experts (the cut makes new parameters, so a
    slice can fall under the threshold its whole tensor is over); under tp a matrix holds
    ``1 / tp`` of its elements on a rank (the plan's shard; vectors whole), an
    approximation of the plan's exact sizes; experts are not split over tp."""
    from meshtrain.estimate.experts import is_expert_name, is_expert_param
    from meshtrain.parallel.blocks import gather_units

    model = facts.model
    experts = {
        id(p)
        for name, p in model.named_parameters(remove_duplicate=False)
        if ep > 1 and (is_expert_param(p) or is_expert_name(name))
    }
    seen: set[int] = set()
    whole, expert_whole, units = 0, 0, []

    def local(p) -> int:
        if id(p) in experts:
            return p.numel() // ep
        return p.numel() // tp if (tp > 1 and p.dim() >= 2) else p.numel()

    for unit in gather_units(model, []):
        sharded = 0
        for p in unit.parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            full = local(p) if id(p) in experts else p.numel()
            if full < PERSISTENCE_THRESHOLD:  # the full size, as assign_units compares
                whole += local(p)
                expert_whole += local(p) if id(p) in experts else 0
            else:
                sharded += local(p)
        units.append(sharded)
    for p in {id(q): q for q in model.parameters()}.values():
        if p.requires_grad and id(p) not in seen:
            whole += local(p)
            expert_whole += local(p) if id(p) in experts else 0
    return whole, units, expert_whole


def per_token_block(facts: ModelFacts, layout: Layout, width: int) -> float:
    """One block's activation bytes per local token on one rank, without checkpointing."""
    method = layout.cp_method if layout.cp > 1 else "all_to_all"
    norms, attention, mlp, small = block_parts(
        _dims(facts), cp=layout.cp, width=width, method=method
    )
    if facts.moe:
        k, h = facts.top_k, facts.hidden
        # experts are not split over tp: every tp rank runs the MoE block whole
        mlp = 4 * facts.n_experts + k * (2 * width * h + 4 * width * facts.expert_ffn)
        return (
            norms / (layout.tp if layout.sequence_parallel else 1)
            + (attention + small) / layout.tp
            + mlp
        )
    t = layout.tp
    return norms / (t if layout.sequence_parallel else 1) + (attention + mlp + small) / t


def packed_masks(facts: ModelFacts, layout: Layout, seq: int, width: int) -> tuple[int, int]:
    """A packed row's attention masks, bytes per sequence: (kept by each block, kept once
    per forward). meshtrain's Decoder builds the ``[L, L]`` document mask in every block and
    SDPA keeps it for the backward converted to the queries' dtype (``width L^2`` a block;
    measured: +34.1 MB on 4 blocks at b 2, L 1,024 fp32, predicted 33.6); transformers
    builds one boolean mask per forward (``L^2``; measured +0.4 MB there). Not split by tp
    (every head shares it). Under context parallelism every family attends through
    meshtrain's seam: ring attention makes each block pair's mask on the fly and again in
    the backward (none kept); all-to-all gathers the whole sequence for its heads and keeps
    the whole ``[L, L]`` mask in every block, as the Decoder does."""
    if not layout.packed or (layout.cp > 1 and layout.cp_method == "ring"):
        return 0, 0
    if facts.family == "decoder" or layout.cp > 1:
        return width * seq * seq, 0
    return 0, seq * seq


def activation_peak(
    facts: ModelFacts, layout: Layout, check: LayoutCheck, seq: int, precision: str
) -> int:
    """Peak activation bytes of the largest pp rank (module docstring)."""
    w, b, t = _width(precision), layout.micro_batch, layout.tp
    s = seq // layout.cp
    h, vocab = facts.hidden, facts.vocab / t
    block = per_token_block(facts, layout, w)
    kept_block = (
        block if not layout.checkpointing else w * h / (t if layout.sequence_parallel else 1)
    )
    head_tok = (4 * h + 2 * w * h + 4) / (t if layout.sequence_parallel else 1) + 8
    if layout.cp > 1:
        head_tok += 4 * facts.head_dim  # the gathered rotary tables
    loss = (s - 1) * (4 * vocab + 8)
    grads = 2 * 4 * s * vocab  # the loss's gradients at the start of the backward
    if layout.loss_chunk:  # loss.chunked: the hidden gradient and the head's, one [C, V] block
        loss = s * 4 * h + 4 * vocab * h + s * 8
        grads = 2 * 4 * min(layout.loss_chunk, s) * vocab
    mask_block, mask_once = packed_masks(facts, layout, seq, w)
    kept_mask = 0 if layout.checkpointing else mask_block
    recompute = (block * s + mask_block) * b if layout.checkpointing else 0
    if layout.pp == 1:
        kept = b * (s * (facts.layers * kept_block + head_tok) + loss)
        kept += b * (facts.layers * kept_mask + mask_once)
        return round(kept + max(b * grads, recompute))
    from meshtrain.parallel.pipeline.schedules import stage_rank

    stages = check.split(layout.pp * layout.virtual_stages)
    best = 0.0
    for r in range(layout.pp):
        per_stage = {}
        for k, st in enumerate(stages):
            if stage_rank(layout.schedule, k, layout.pp) != r:
                continue
            n_blocks = len(getattr(st, "block_ids", ()))
            last = getattr(st, "is_last", False)
            per_stage[k] = round(
                b * (s * n_blocks * kept_block + (s * head_tok + loss if last else 0))
                + b * (n_blocks * kept_mask + mask_once)
            )
        p, mb, v = layout.pp, layout.grad_accum, layout.virtual_stages
        if check.walks(p, mb, v):
            sched = check.schedule(layout.schedule, p, mb, v)
            peak = alive_peak(sched.actions[r], per_stage, layout.schedule)
        else:  # the closed forms of estimate.pipeline's docstring, in (chunk) micro-batches
            alive = {
                "gpipe": mb,
                "1f1b": min(mb, p - r),
                "zb_h1": min(mb, p),
                "zbv": min(2 * mb, 2 * p, mb + 1 + r),
                "dualpipev": 2 * p + 1,
            }.get(layout.schedule, min(v * mb, (v - 1) * p + 2 * (p - 1 - r) + 1))
            peak = alive * max(per_stage.values())
        last_here = any(getattr(stages[k], "is_last", False) for k in per_stage)
        best = max(best, peak + max(b * grads if last_here else 0, recompute))
    return round(best)


def alive_peak(actions, per_stage: dict[int, int], schedule: str) -> int:
    """The most activation bytes alive on one rank walking its action list: a forward
    adds its stage's bytes, the backward that frees them (``W`` for zb_h1, zbv, dualpipev) takes them
    away (``estimate.pipeline.peak_activations``' walk, over the planner's cached
    schedule instead of a new one per call)."""
    from meshtrain.parallel.pipeline.schedules import F, frees_activations

    free = frees_activations(schedule)
    alive = dict.fromkeys(per_stage, 0)
    peak = 0
    for a in actions:
        if a.kind == F or a.kind == free:
            alive[a.stage] += 1 if a.kind == F else -1
            peak = max(peak, sum(n * per_stage[k] for k, n in alive.items()))
    return peak


def buffers(
    facts: ModelFacts,
    layout: Layout,
    states_params: int,
    seq: int,
    precision: str,
    units: list[int] | None = None,
) -> int:
    """Communication buffers of one rank (module docstring)."""
    w, b, s = _width(precision), layout.micro_batch, seq // layout.cp
    h, t = facts.hidden, layout.tp
    total = 0
    if layout.stage == 3 and units:  # a unit gathered and its neighbour prefetched
        pairs = [a + b for a, b in zip(units, units[1:], strict=False)] or units
        total += w * max(pairs)
    if layout.pp > 1:
        total += 2 * w * b * s * h // (t if layout.sequence_parallel else 1)
    if layout.cp > 1 and layout.cp_method == "ring":
        total += 2 * 2 * w * b * s * facts.kv_heads * facts.head_dim
    if layout.ep > 1:
        total += 2 * w * b * s * facts.top_k * h
    return int(total)


def predict_memory(
    facts: ModelFacts,
    layout: Layout,
    check: LayoutCheck,
    hw: Hardware,
    *,
    seq: int,
    precision: str,
    optimizer: str,
    cache: dict | None = None,
) -> MemoryBreakdown:
    """The largest rank's memory (module docstring); ``cache``: see ``model_states``."""
    states = model_states(facts, layout, check, precision, optimizer, cache)
    states = max(states, key=lambda x: x.total)
    acts = activation_peak(facts, layout, check, seq, precision)
    units = None
    if layout.stage == 3:
        key = ("zero3_units", layout.tp, layout.ep)
        if cache is not None and key in cache:
            units = cache[key]
        else:
            units = zero3_units(facts, layout.tp, layout.ep)[1]
            if cache is not None:
                cache[key] = units
    buf = buffers(facts, layout, states.params, seq, precision, units)
    return MemoryBreakdown(states, acts, buf, hw.overhead_bytes)
