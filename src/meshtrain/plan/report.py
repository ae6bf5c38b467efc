"""What ``meshtrain plan`` prints: the ranked table, why the winner wins, and the reasons
nothing fits (which constraint to relax, and by how much)."""

from __future__ import annotations

from meshtrain.plan.prediction import Prediction

__all__ = ["nothing_fits", "ranked_table", "why_line"]

GiB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def ranked_table(preds: list[Prediction], top: int = 12) -> str:
    """The first ``top`` rows (fits, memory GiB, host RAM per rank while loading, step s,
    tokens/s per device, MFU, bottleneck)."""
    head = ["#", "layout", "fits", "mem GiB", "load GiB", "step s", "tok/s/dev", "MFU",
            "bottleneck"]  # fmt: skip
    rows = []
    for i, p in enumerate(preds[:top], 1):
        rows.append([
            str(i), p.layout.label(), "yes" if p.fits else "no", _gib(p.memory.total),
            _gib(p.host.peak), f"{p.time.total:.3g}", f"{p.tokens_per_s:,.0f}", f"{100 * p.mfu:.1f}%", p.bottleneck,
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    left = {1, 2, 8}

    def fmt(r: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt(head), *(fmt(r) for r in rows)])


def _biggest_gap(a: Prediction, b: Prediction) -> tuple[str, float, float]:
    pa, pb = a.time.parts(), b.time.parts()
    keys = set(pa) | set(pb)
    k = max(keys, key=lambda k: pb.get(k, 0.0) - pa.get(k, 0.0))
    return k, pa.get(k, 0.0), pb.get(k, 0.0)


def why_line(preds: list[Prediction]) -> str:
    """One line: why the first fitting layout wins over the next one, and over any faster
    layout that does not fit."""
    fitting = [p for p in preds if p.fits]
    if not fitting:
        return "no layout fits (see below)"
    win = fitting[0]
    parts = [f"{win.layout.label()} wins"]
    if len(fitting) > 1:
        nxt = fitting[1]
        k, a, b = _biggest_gap(win, nxt)
        gain = win.tokens_per_s / nxt.tokens_per_s - 1
        if win.padding != nxt.padding:  # the same layout but its rows: padding decides
            packed, padded = (win, nxt) if win.layout.packed else (nxt, win)
            parts.append(
                f"{100 * gain:.1f}% more data tokens/s than {nxt.layout.label()} "
                f"({100 * padded.padding:.0f}% of unpacked rows are padding; packed rows "
                f"add {_gib(packed.memory.total - padded.memory.total)} GiB of masks)"
            )
        elif gain > 1e-9:
            parts.append(
                f"{100 * gain:.1f}% faster than {nxt.layout.label()} (its {k} takes "
                f"{b:.3g} s a step, the winner's {a:.3g} s)"
            )
        else:
            parts.append(
                f"as fast as {nxt.layout.label()} and {_gib(nxt.memory.total - win.memory.total)} "
                "GiB lighter or equal (ties go to less memory)"
            )
    faster = [p for p in preds if not p.fits and p.tokens_per_s > win.tokens_per_s]
    if faster:
        f = max(faster, key=lambda p: p.tokens_per_s)
        parts.append(
            f"{f.layout.label()} would be {100 * (f.tokens_per_s / win.tokens_per_s - 1):.1f}% "
            f"faster but needs {_gib(f.memory.total)} GiB > the {_gib(f.limit)} GiB limit"
        )
    return "; ".join(parts)


def nothing_fits(preds: list[Prediction], limit: int, gpus: int) -> str:
    """Which constraint to relax, by how much, when no layout fits."""
    if not preds:
        return "no layout is accepted by meshtrain for this model and these sizes"
    least = min(preds, key=lambda p: p.memory.total)
    need = least.memory.total
    per_gpu_states = least.memory.states.total
    lines = [
        f"no layout fits in {_gib(limit)} GiB per device: the lightest, "
        f"{least.layout.label()}, needs {_gib(need)} GiB "
        f"(model states {_gib(per_gpu_states)}, activations {_gib(least.memory.activations)}, "
        f"buffers {_gib(least.memory.buffers)}, overhead {_gib(least.memory.overhead)})",
        f"  relax --max-memory: to at least {_gib(need)} GiB (+{_gib(need - limit)})",
    ]
    if least.memory.activations > need - limit:
        lines.append(
            "  relax --seq or --global-batch: activations are "
            f"{_gib(least.memory.activations)} GiB of it; a shorter sequence shrinks them"
        )
    # more devices divide the model states (ZeRO-3) and the activations (cp or tp) alike;
    # the overhead stays per device
    room = limit - least.memory.overhead
    if room > 0:
        more = max(gpus + 1, -(-(need - least.memory.overhead) * gpus // room))
        lines.append(
            f"  relax --gpus: about {more} devices (model states and activations divide "
            f"over them; {_gib(need - least.memory.overhead)} GiB on {gpus} now)"
        )
    return "\n".join(lines)
