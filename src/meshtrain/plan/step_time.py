"""Seconds per optimizer step of one layout: compute, the exposed part of each group's
communication, the pipeline bubble, the optimizer step and fixed overheads.

**Compute.** FLOPs per token ``6 N_a + 12 L d T`` (``engine.flops``, PaLM's count; ``N_a``
the parameters a token passes: the dense ones and ``k / E`` of the experts), ``x 4/3``
with activation checkpointing (the forward runs twice), divided over ``tp x pp`` ranks and
``cp`` chunks of the sequence, at ``Hardware.peak_flops x efficiency``. CPU ranks that
outnumber the cores share them (``Hardware.slowdown``).

**Communication**, bytes each rank sends per step (a link is full duplex: what it receives
arrives meanwhile), from the accounting ``distributed.comm`` records and
``parallel.zero.plan`` states (an all-reduce of ``b`` bytes moves ``2 b (n-1)/n`` per rank,
a reduce-scatter or all-gather of a full buffer ``b`` moves ``b (n-1)/n``), over the link
the group spans (``bw_intra`` when its ranks fit on one node, else ``bw_inter``; the mesh
order ``pp, dp, cp, tp`` puts tp innermost):

===========  ===================================================  ========================
group        bytes per step (one rank)                            overlap (as the engine)
===========  ===================================================  ========================
dp (ZeRO)    stage 0: all-reduce ``2 s_g Psi``; 1: ``s_g Psi``     gradient buckets overlap
             + ``s Psi``; 2: ``m s_g Psi + s Psi``; 3:             each backward (2/3 of a
             ``m (2 s Psi_u + s_g Psi)`` (``Psi_u`` in units;     micro-step); the param
             the kept-whole parameters' gradients all-reduced),    all-gather after the step
             over ``dp cp`` (experts over ``dp cp / ep``)
                                                                   does not; stage 3's
                                                                   gathers are prefetched
tp           4 all-reduces of ``w b s h`` per block and            none (on the critical
             micro-batch (6 with checkpointing), 2 more for the    path)
             embedding and the head, 3 fp32 ``[b, s-1]`` (loss)
cp ring      ``(cp - 1)`` key/value blocks ``2 w b s kv`` forward, with attention (each
             twice that backward                                   block's compute)
cp a2a       8 all-to-alls of ``w b s h`` per block                 none
pp           an activation or a gradient ``w b s h`` per           none
             micro-batch (a middle stage: both)
ep           4 all-to-alls of ``w b s k h`` per MoE block          none
===========  ===================================================  ========================

**Bubble.** The idle fraction ``f`` of the schedule's own action lists
(``pipeline.validate.idle_fraction`` of ``build_schedule`` with a backward twice a
forward); the pipeline's compute is stretched to ``compute / (1 - f)``.

**Optimizer step.** Memory-bound: ``(K + 2 s) Psi_shard`` read and written at the
device's memory bandwidth, or the host's with optimizer offload plus the gradient
and parameter copies over the host link.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtrain.engine.flops import flops_per_token
from meshtrain.estimate.model_states import optimizer_state_bytes
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.layout import Layout
from meshtrain.plan.model_facts import ModelFacts
from meshtrain.plan.validity import LayoutCheck

__all__ = ["StepTime", "predict_time"]


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part; ``comm`` holds each group's exposed seconds."""

    compute: float
    bubble: float
    comm: dict[str, float] = field(default_factory=dict)
    optimizer: float = 0.0
    overhead: float = 0.0
    comm_bytes: dict[str, float] = field(default_factory=dict)  # wire bytes per rank

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.comm.values()) + self.optimizer + self.overhead

    def parts(self) -> dict[str, float]:
        out = {"compute": self.compute, "bubble": self.bubble}
        out.update({f"comm:{k}": v for k, v in self.comm.items()})
        out.update(optimizer=self.optimizer, overhead=self.overhead)
        return out

    @property
    def bottleneck(self) -> str:
        """The largest part after compute (what to attack), or compute itself."""
        parts = {k: v for k, v in self.parts().items() if v > 0}
        worst = max(parts, key=parts.get) if parts else "compute"
        return worst


def step_flops_per_token(facts: ModelFacts, seq: int) -> float:
    """Model FLOPs per token, ``6 N_a + 12 L d T`` (module docstring)."""
    return flops_per_token(round(facts.active_params), facts.layers, facts.hidden, seq)


def _ring(nbytes: float, n: int) -> float:
    return nbytes * (n - 1) / n if n > 1 else 0.0


def _link(hw: Hardware, span: int) -> float:
    return hw.bw_intra if span <= hw.gpus_per_node else hw.bw_inter


def predict_time(
    facts: ModelFacts,
    layout: Layout,
    check: LayoutCheck,
    hw: Hardware,
    *,
    seq: int,
    precision: str,
    optimizer: str,
    trainable_per_rank: int,
    zero3_whole: tuple[int, int] = (0, 0),
    experts_per_rank: int = 0,
) -> StepTime:
    """The step time of ``layout`` (module docstring). ``trainable_per_rank``: the largest
    rank's trainable parameters before ZeRO (its ``Psi_r``, from the memory model);
    ``zero3_whole``: at stage 3, the elements that rank keeps whole (dense, experts;
    ``plan.memory.zero3_units``), the rest is gathered by unit; ``experts_per_rank``: the part of ``trainable_per_rank``
    that is this rank's experts under ep (reduced over the expert replicas, not dp)."""
    w = 4 if precision == "fp32" else 2
    b, m, t, cp = layout.micro_batch, layout.grad_accum, layout.tp, layout.cp
    s = seq // cp
    ranks_per_node = min(layout.world, hw.gpus_per_node)
    speed = hw.peak_flops * hw.efficiency / hw.slowdown(ranks_per_node)
    flops = step_flops_per_token(facts, seq) * b * seq / (cp * t * layout.pp)
    if layout.checkpointing:
        flops *= 4 / 3
    t_mb = flops / speed
    compute = m * t_mb
    bubble = 0.0
    if layout.pp > 1:
        f = check.bubble(layout.schedule, layout.pp, m, layout.virtual_stages)
        bubble = compute * f / (1 - f)
    blocks_r = facts.layers / layout.pp
    comm: dict[str, float] = {}
    wire: dict[str, float] = {}

    # data parallel / ZeRO over the replicas (dp x cp); experts over edp
    n_rep = layout.dp * cp
    psi = trainable_per_rank
    expert = experts_per_rank if facts.moe and layout.ep > 1 else 0
    psi -= expert
    grad_w = w
    z = layout.stage
    by_group = {
        "dp": (psi, n_rep, zero3_whole[0]),
        "edp": (expert, n_rep // layout.ep, zero3_whole[1]),
    }
    for name, (n_params, n, whole) in by_group.items():
        if n <= 1 or n_params <= 0:
            continue
        span = n * cp * t if name == "dp" else n * t
        bw = _link(hw, span)
        if z == 0:
            reduce_b, gather_b, per_mb = _ring(2 * grad_w * n_params, n), 0.0, False
        elif z == 1:
            reduce_b, gather_b, per_mb = _ring(grad_w * n_params, n), _ring(w * n_params, n), False
        elif z == 2:
            reduce_b, gather_b, per_mb = _ring(grad_w * n_params, n), _ring(w * n_params, n), True
        else:
            # parameters kept whole are not gathered, and their gradients are all-reduced
            whole = min(whole, n_params)
            in_units = n_params - whole
            reduce_b = _ring(grad_w * (n_params - whole), n) + _ring(2 * grad_w * whole, n)
            gather_b, per_mb = _ring(2 * w * in_units, n), True
        backward = 2 / 3 * t_mb
        if z == 3:  # gathers prefetched under the forward and backward of each micro-step
            exposed = m * (max(0.0, (reduce_b + gather_b) / bw - t_mb))
            total_b = m * (reduce_b + gather_b)
        elif per_mb:
            exposed = m * max(0.0, reduce_b / bw - backward) + gather_b / bw
            total_b = m * reduce_b + gather_b
        else:
            exposed = max(0.0, reduce_b / bw - backward) + gather_b / bw
            total_b = reduce_b + gather_b
        comm[name], wire[name] = exposed, total_b
    if t > 1:
        calls = 6 if layout.checkpointing else 4
        per = _ring(2 * w * b * s * facts.hidden, t)
        # the vocab-parallel embedding's output and the head's input gradient (all-reduced
        # [b, s, h]) and the loss's three fp32 [b, s - 1] all-reduces: on the first and
        # the last stage, both on one rank without a pipeline
        ends = (2 if layout.pp == 1 else 1) * per + 3 * _ring(2 * 4 * b * (s - 1), t)
        wire["tp"] = m * (blocks_r * calls * per + ends)
        comm["tp"] = wire["tp"] / _link(hw, t)
    if cp > 1:
        bw = _link(hw, cp * t)
        kv = facts.kv_heads * facts.head_dim / (t if t > 1 else 1)
        if layout.cp_method == "ring":
            per = (cp - 1) * 2 * w * b * s * kv * 3  # forward once, backward twice
            wire["cp"] = m * blocks_r * per
            attention = t_mb / max(1, blocks_r) * 0.3  # attention's share of a block
            comm["cp"] = m * blocks_r * max(0.0, per / bw - attention)
        else:
            per = 8 * _ring(w * b * s * facts.hidden / t, cp)
            wire["cp"] = m * blocks_r * per
            comm["cp"] = wire["cp"] / bw
    if layout.pp > 1:
        act = w * b * s * facts.hidden / (t if layout.sequence_parallel else 1)
        # sent: the first stage its activations, the last its gradients, a middle one both
        wire["pp"] = (2 if layout.pp > 2 else 1) * m * act
        comm["pp"] = wire["pp"] / _link(hw, layout.world)
    if layout.ep > 1:
        per = 4 * _ring(w * b * s * facts.top_k * facts.hidden, layout.ep)
        wire["ep"] = m * blocks_r * per
        comm["ep"] = wire["ep"] / _link(hw, layout.ep * t)

    k = optimizer_state_bytes(optimizer, precision)
    shard = trainable_per_rank / (n_rep if z >= 1 else 1)
    if layout.offload_optimizer:  # the host steps; gradients go down, parameters come up
        host_bw = min(hw.hbm, 20e9) if hw.cores == 0 else hw.hbm
        opt = (k + 2 * w) * shard * 2 / host_bw + 2 * w * shard / hw.host_link
    else:
        opt = (k + 2 * w) * shard * 2 / hw.hbm
    if layout.offload_param:
        opt += m * 2 * w * trainable_per_rank / n_rep / hw.host_link
    overhead = hw.micro_step_s * (m + layout.pp - 1) + hw.step_s  # the pipeline: m + p - 1 slots
    return StepTime(compute, bubble, comm, opt, overhead, wire)
