"""``meshtrain plan --config MY.json``: a given config's memory breakdown, and the cheapest
single changes that make it fit under the limit, each with its predicted cost in speed.

A *single change* is one knob turned one notch from the config's layout: the next ZeRO
stage, optimizer offload, parameter offload (stage 3), activation checkpointing, half the
micro-batch (twice the accumulation, the same global batch), sequence parallelism, and
twice the tp, pp or cp degree taken from dp. Each goes through the same checks as the
search (``Planner.refusal``): a change meshtrain would refuse is never advised. The ones
that fit are sorted by predicted step time, so the first costs the least speed.
"""

from __future__ import annotations

from meshtrain.plan.layout import Layout
from meshtrain.plan.planner import Planner
from meshtrain.plan.prediction import Prediction

__all__ = ["advice", "breakdown", "single_changes"]

GiB = 1 << 30


def breakdown(pred: Prediction) -> str:
    """The memory lines of one prediction (GiB), with its step time and what bounds it."""
    m = pred.memory
    lines = [
        f"layout {pred.layout.label()} on {pred.layout.world} device(s): "
        f"{m.total / GiB:.2f} GiB per device (limit {pred.limit / GiB:.2f} GiB): "
        + ("fits" if pred.fits else f"does NOT fit, {(m.total - pred.limit) / GiB:.2f} GiB over"),
    ]
    for k, v in m.parts().items():
        lines.append(f"  {k:<12}{v / GiB:9.3f} GiB")
    if m.states.host:
        lines.append(f"  {'host':<12}{m.states.host / GiB:9.3f} GiB (offloaded, CPU memory)")
    h = pred.host
    lines.append(
        f"host RAM while loading: {h.peak / GiB:.2f} GiB per rank at its {h.phase} "
        f"(build {h.build / GiB:.2f}, wrap {h.wrap / GiB:.2f}, settled {h.settled / GiB:.2f}), "
        f"{h.per_node / GiB:.2f} GiB for the {h.ranks_per_node} rank(s) of a node"
    )
    t = pred.time
    lines.append(
        f"step {t.total:.3g} s, {pred.tokens_per_s:,.0f} tokens/s per device, MFU "
        f"{100 * pred.mfu:.1f}%, bound by {t.bottleneck}"
    )
    return "\n".join(lines)


def _candidates(x: Layout) -> list[tuple[str, Layout]]:
    out = []
    if x.stage < 3 and not (x.pp > 1 and x.stage == 2):
        out.append(
            (f"zero_optimization.stage {x.stage} -> {x.stage + 1}", x.but(stage=x.stage + 1))
        )
    if x.stage >= 1 and not x.offload_optimizer:
        out.append(
            ("zero_optimization.offload_optimizer.device cpu", x.but(offload_optimizer=True))
        )
    if x.stage == 3 and not x.offload_param:
        out.append(
            (
                "zero_optimization.offload_param.device cpu",
                x.but(offload_optimizer=True, offload_param=True),
            )
        )
    if not x.checkpointing:
        out.append(("activation_checkpointing.enabled true", x.but(checkpointing=True)))
    if x.micro_batch > 1 and x.micro_batch % 2 == 0:
        out.append((
            f"train_micro_batch_size_per_gpu {x.micro_batch} -> {x.micro_batch // 2} "
            f"(gradient_accumulation_steps {x.grad_accum} -> {2 * x.grad_accum})",
            x.but(micro_batch=x.micro_batch // 2, grad_accum=2 * x.grad_accum),
        ))  # fmt: skip
    if x.tp > 1 and not x.sequence_parallel:
        out.append(("tensor_parallel.sequence_parallel true", x.but(sequence_parallel=True)))
    if x.dp % 2 == 0:
        half = x.dp // 2
        per_replica = x.micro_batch * x.grad_accum * 2  # the same global batch over half the dp
        for name, key in (("tensor", "tp"), ("pipeline", "pp"), ("context", "cp")):
            val = getattr(x, key)
            # half the replicas: each takes twice the rows, by accumulation
            y = x.but(dp=half, grad_accum=per_replica // x.micro_batch, **{key: 2 * val})
            if key == "pp" and y.stage == 3:
                continue
            out.append((f"mesh.{name}_parallel_size {val} -> {2 * val} (dp {x.dp} -> {half})", y))
    return out


def single_changes(planner: Planner, current: Prediction) -> list[tuple[str, Prediction]]:
    """The single changes meshtrain accepts, predicted; those that fit first, each group
    by step time (module docstring)."""
    found = []
    for what, layout in _candidates(current.layout):
        if planner.refusal(layout) is not None:
            continue
        found.append((what, planner.predict(layout)))
    found.sort(key=lambda wp: (not wp[1].fits, wp[1].time.total))
    return found


def advice(planner: Planner, current: Prediction, limit: int = 6) -> str:
    """The lines printed under the breakdown: the cheapest changes that fit."""
    changes = single_changes(planner, current)
    fit = [(w, p) for w, p in changes if p.fits]
    if current.fits and not fit:
        return "it fits; no single change is needed"
    head = "it fits; single changes that also fit:" if current.fits else (
        "cheapest single changes that make it fit:" if fit else
        "no single change makes it fit; the closest:"
    )  # fmt: skip
    shown = fit[:limit] if fit else changes[:limit]
    lines = [head]
    for what, p in shown:
        cost = p.time.total / current.time.total - 1
        lines.append(
            f"  {what}: {p.memory.total / GiB:.2f} GiB, step {p.time.total:.3g} s "
            f"({'+' if cost >= 0 else ''}{100 * cost:.1f}% time)"
        )
    return "\n".join(lines)
