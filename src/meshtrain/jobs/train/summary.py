"""The closing summary of ``meshtrain train``: training and held-out loss, throughput, memory
and bytes vs theory, the generated sample, and last the command that serves the run.

The held-out line reads the ``eval_*`` rows of ``metrics.jsonl`` (``jobs.train.heldout``:
a token-weighted mean over every rank): the last evaluation, and the first one for how
far it fell.

Communication theory per optimizer step, from the engine's own flat buffers (see
``meshtrain.parallel.zero.plan`` for the derivation). ``P`` is the bytes of a group's padded
flat buffer in the model dtype (each bucket rounded up to a multiple of the data-parallel
size ``N``; stage 0 pads nothing), ``k`` is gradient_accumulation_steps:

=======  ===========================================================================
stage    bytes per optimizer step (ZeRO paper volume, comm.py's convention)
=======  ===========================================================================
0        all-reduce of the gradients: 2 P
1        reduce-scatter of the gradients P + all-gather of the parameters P = 2 P
2        a reduce-scatter on every backward k P + the all-gather P = (k + 1) P
3        per micro-step two all-gathers and a reduce-scatter of sharded groups: 3 k P
         (groups kept whole under stage 3, e.g. small parameters, move as stage 2)
=======  ===========================================================================

The measured figure is what the last step recorded on the groups that hold model state
(``MODEL_STATE_GROUPS``: the replicas dp or dp x cp, and a MoE model's expert-data-parallel
group edp), without the 8-byte ``control`` all-reduce of the gradient norm. Activations are
not model state and the theory does not count them: tensor parallelism's all-reduces and
gathers (``tp``), context parallelism's key/value blocks (``cp``), the pipeline's
sends (``pp``), a MoE model's token ``all_to_all`` (``ep``) and tied weights summed over
stages (``pp_tied``) get their own line, by group. With ``N = 1`` nothing moves and the
theory is 0. Tied weights under stage 3 are gathered once per use, so they add to the
measured bytes.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, is_dataclass
from typing import Any


def comm_theory(engine: Any) -> tuple[int, str]:
    """(bytes per optimizer step, the formula in words) for this engine's layout."""
    n = engine.topology.replica_group.size
    stage = engine.zero_stage
    k = int(engine.gas)
    if n == 1:
        return 0, "one replica of the model state: nothing to reduce"
    total = engine.zero.comm_bytes_theory(k)
    padded = sum(g.numel * g.itemsize for g in engine.zero.flat_groups)
    words = {
        0: "2 x P (all-reduce of gradients)",
        1: "2 x P (reduce-scatter of gradients + all-gather of parameters)",
        2: f"(k + 1) x P with k = {k} (reduce-scatter every backward + all-gather)",
        3: f"3 x k x P with k = {k} (two all-gathers + one reduce-scatter per micro-step; "
        "tied weights are gathered once per use, which the theory does not count)",
    }[stage]
    return total, f"{words}, P = {_mb(padded)} padded flat buffers"


MODEL_STATE_GROUPS = ("dp", "dp_cp", "edp")


def measured_comm(engine: Any) -> tuple[int, dict[str, int], dict[str, int]]:
    """(model-state bytes of the last step, those bytes by op, every other group's bytes
    by group name): the control all-reduces left out of both."""
    state: dict[str, int] = {}
    other: dict[str, int] = {}
    for (op, group), n in engine.last_step_comm_by_group().items():
        if op == "control":
            continue
        if group in MODEL_STATE_GROUPS:
            state[op] = state.get(op, 0) + n
        else:
            other[group] = other.get(group, 0) + n
    return sum(state.values()), state, other


def _mb(n: float) -> str:
    """Bytes in decimal units (the ZeRO paper's GB are 1e9 bytes)."""
    if n < 1e3:
        return f"{n:.0f} B"
    return f"{n / 1e3:,.1f} kB" if n < 1e6 else f"{n / 1e6:,.2f} MB"


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def _eval_facts(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl evaluation row as summary.json keeps it."""
    return {
        "step": row["step"],
        "loss": row["eval_loss"],
        "perplexity": row.get("eval_perplexity"),
        "tokens": int(row.get("eval_tokens") or 0),
        "rows": int(row.get("eval_rows") or 0),
    }


def _plain(obj: Any) -> Any:
    """A JSON-safe view of a memory report (a dataclass, or whatever the engine returns)."""
    if is_dataclass(obj):
        return {k: _plain(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, int | float | str | bool) or obj is None:
        return obj
    return str(obj)


def build_summary(
    engine: Any,
    *,
    history: list[dict[str, Any]],
    this_run: list[dict[str, Any]],
    wall_seconds: float,
    start_step: int,
    max_steps: int,
    n_params: int,
    model_line: str,
    outputs: list[str],
    sample: dict[str, str] | None = None,
    serve_dir: str | None = None,
    serve_note: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """The text printed at the end of a run, and the same facts as a dict (summary.json).

    ``history`` is every metrics row of the output directory (earlier runs included),
    ``this_run`` the rows of this run. ``sample``: the generated text
    (``jobs.train.sample.samples``); ``serve_dir``: the output folder ``meshtrain serve``
    takes (the last line), or None with ``serve_note`` saying why not.
    """
    losses = [r for r in history if r.get("loss") is not None]
    evals = [r for r in history if r.get("eval_loss") is not None]
    first, last = (losses[0], losses[-1]) if losses else (None, None)
    tail = [r["loss"] for r in losses[-10:]]
    # throughput over this run's steps after the first (which includes warm-up work)
    timed = this_run[1:] if len(this_run) > 1 else this_run
    seconds = sum(r.get("step_seconds") or 0.0 for r in timed)
    tokens = sum((r.get("tokens_per_s") or 0.0) * (r.get("step_seconds") or 0.0) for r in timed)
    samples = sum((r.get("samples_per_s") or 0.0) * (r.get("step_seconds") or 0.0) for r in timed)
    tok_s = tokens / seconds if seconds else 0.0
    smp_s = samples / seconds if seconds else 0.0
    theory, formula = comm_theory(engine)
    measured, by_op, by_group = measured_comm(engine)
    report = engine.memory_report() if hasattr(engine, "memory_report") else None

    lines = [
        f"meshtrain train: reached step {engine.global_steps} of {max_steps} in "
        f"{_duration(wall_seconds)}" + (f" (resumed at step {start_step})" if start_step else ""),
        f"  model       {model_line}, {n_params:,} parameters; ZeRO stage {engine.zero_stage}, "
        f"{engine.topology.dp_size} data-parallel rank(s), {engine.config.precision}",
    ]
    if first is not None:
        lines.append(
            f"  loss        {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} "
            f"at step {last['step']} (mean of the last {len(tail)}: {sum(tail) / len(tail):.4f})"
        )
    if evals:
        e0, e1 = evals[0], evals[-1]
        lines.append(
            f"  held-out    loss {e1['eval_loss']:.4f}, perplexity {e1['eval_perplexity']:,.1f} "
            f"at step {e1['step']} (token-weighted over {int(e1['eval_tokens']):,} tokens of "
            f"{int(e1['eval_rows']):,} rows never trained on)"
            + (
                f"; {e0['eval_loss']:.4f} (perplexity {e0['eval_perplexity']:,.1f}) at step "
                f"{e0['step']}"
                if len(evals) > 1
                else ""
            )
        )
    if timed:
        lines.append(
            f"  throughput  {tok_s:,.0f} tokens/s, {smp_s:,.1f} samples/s over "
            f"{len(timed)} steps of this run (all ranks; the first step is left out)"
        )
    mfu = engine.log.mfu(tok_s) if timed and hasattr(engine.log, "mfu") else None
    if mfu is not None:
        lines.append(f"  MFU         {100 * mfu[0]:.1f}% (peak: {mfu[1]})")
    if report is not None:
        lines.append("  memory      " + str(report).replace("\n", "\n              "))
    ratio = f", measured / theory = {measured / theory:.3f}" if theory else ""
    ops = ", ".join(f"{op} {_mb(b)}" for op, b in sorted(by_op.items()))
    lines.append(
        f"  comm/step   model state {_mb(measured)} ({ops or 'none'}) vs theory "
        f"{_mb(theory)} = {formula}{ratio}"
    )
    lines.append(
        "              (ZeRO-paper volume: all-reduce counted 2x, reduce-scatter and "
        "all-gather 1x the full buffer; the norm's control bytes left out)"
    )
    if by_group:
        groups = ", ".join(f"{g} {_mb(b)}" for g, b in sorted(by_group.items()))
        lines.append(f"              activations and other groups: {groups} (no theory)")
    moe = engine.log.last
    if "tokens_per_expert_min" in moe:
        lines.append(
            f"  experts     tokens per expert {moe['tokens_per_expert_min']}-"
            f"{moe['tokens_per_expert_max']} (fewest-most over layers and experts, last step); "
            f"token all-to-all {_mb(moe['all_to_all_bytes'])} per step"
        )
    lines.append("  outputs     " + "\n              ".join(outputs))
    if sample is not None:
        lines.append(f"  sample      prompt (held-out text): {sample['prompt']}")
        lines.append(f"              greedy:  {sample['prompt']}[{sample['greedy']}]")
        lines.append(
            f"              sampled: {sample['prompt']}[{sample['sampled']}] ({sample['how']})"
        )
    if serve_dir is not None:
        lines.append(f"  serve       meshtrain serve {shlex.quote(serve_dir)}")
    elif serve_note:
        lines.append(f"  serve       not available: {serve_note}")
    facts = {
        "global_step": engine.global_steps,
        "max_steps": max_steps,
        "start_step": start_step,
        "wall_seconds": round(wall_seconds, 3),
        "loss_first": first,
        "loss_last": last,
        "tokens_per_s": tok_s,
        "samples_per_s": smp_s,
        "mfu": None if mfu is None else mfu[0],
        "mfu_peak_source": None if mfu is None else mfu[1],
        "parameters": n_params,
        "zero_stage": engine.zero_stage,
        "dp_size": engine.topology.dp_size,
        "precision": engine.config.precision,
        "comm_bytes_per_step": {
            "measured": measured,
            "theory": theory,
            "by_op": by_op,
            "other_groups": by_group,
        },
        "comm_formula": formula,
        "memory": _plain(report),
        "heldout_first": _eval_facts(evals[0]) if evals else None,
        "heldout_last": _eval_facts(evals[-1]) if evals else None,
        "sample": sample,
        "serve_command": None if serve_dir is None else f"meshtrain serve {shlex.quote(serve_dir)}",
        "serve_note": serve_note,
    }
    return "\n".join(lines), facts


__all__ = ["build_summary", "comm_theory", "measured_comm"]
