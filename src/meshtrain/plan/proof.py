"""The tables of docs/plan.md: the planner's predictions beside measured runs on this
machine's CPU ranks, and beside published GPU runs.

``python -m meshtrain.plan.proof measure OUT.json`` runs every layout of ``MEASURED`` on
1, 2 or 4 CPU ranks (``measure.measure``), with the load average beside each, and writes
measured and predicted memory and step time; ``python -m meshtrain.plan.proof published``
prints the published-run table (no measurement; ``plan.published``). ``measure`` calibrates first
(``meshtrain plan --calibrate``'s runs, stored as it stores them), so the constants and the
table see the same load.
"""

from __future__ import annotations

import json
import statistics
import sys

from meshtrain.plan.layout import Layout
from meshtrain.plan.proof_rows import (
    BIG_DECODER,
    BIG_LLAMA,
    BIG_MIXTRAL,
    DECODER,
    LLAMA,
    LOADED,
    MEASURED,
    MIXTRAL,
    PACKED,
    PACKED_SEQ,
    SEQ,
    SLICED,
    ZERO_INIT,
)
from meshtrain.plan.published import predict_published

# the rows live in proof_rows; named here too, as the tables' own inputs
__all__ = [
    "BIG_DECODER",
    "BIG_LLAMA",
    "BIG_MIXTRAL",
    "DECODER",
    "LLAMA",
    "LOADED",
    "MEASURED",
    "MIXTRAL",
    "PACKED",
    "PACKED_SEQ",
    "SEQ",
    "SLICED",
    "ZERO_INIT",
    "run_load",
    "run_packed",
    "spearman",
]


def run_packed(out: str) -> list[dict]:
    """Peak tensor memory of packed rows (``PACKED``), measured beside the prediction."""
    from dataclasses import replace

    from meshtrain.plan.calibrate import load_average, planner_for
    from meshtrain.plan.hardware import Hardware
    from meshtrain.plan.measure import measure

    hw = replace(Hardware.cpu(), overhead_bytes=0)
    rows = []
    for name, cfg, layout in PACKED:
        load = load_average()
        got = measure(cfg, layout, seq=PACKED_SEQ, steps=2)["peak_tensor_bytes"]
        planner = planner_for(cfg, hw, layout.world, PACKED_SEQ, layout.global_batch)
        pred = planner.predict(layout).memory.tensors
        rows.append({"model": name, "layout": layout.label(), "world": layout.world,
                     "load": load, "measured": got, "predicted": pred,
                     "error": pred / got - 1})  # fmt: skip
        print(f"{name:<8} {layout.label():<34} {got / 2**20:7.2f} MiB measured, "
              f"{pred / 2**20:7.2f} predicted {pred / got - 1:+.1%}  load {load}", flush=True)  # fmt: skip
    with open(out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    return rows


def run_load(out: str) -> list[dict]:
    """Host RAM per rank while loading, measured (``measure`` with ``steps=0``) beside
    ``plan.host_memory``'s prediction, for every row of ``LOADED``."""
    from meshtrain.plan.calibrate import load_average, planner_for
    from meshtrain.plan.hardware import Hardware
    from meshtrain.plan.measure import measure

    hw = Hardware.cpu()
    rows = []
    runs = [(r, "whole") for r in LOADED] + [(r, "sliced") for r in SLICED]
    runs += [(r, "zero-init") for r in ZERO_INIT]
    for (name, cfg, layout), loading in runs:
        load = load_average()
        got = measure(cfg, layout, seq=SEQ, steps=0, loading=loading)["load_peak"]
        planner = planner_for(cfg, hw, layout.world, SEQ, layout.global_batch, loading=loading)
        host = planner.predict(layout).host
        name = name if loading == "whole" else f"{name} {loading}"
        rows.append({"model": name, "layout": layout.label(), "world": layout.world,
                     "load": load, "measured": got, "predicted": host.peak,
                     "phase": host.phase, "error": host.peak / got - 1})  # fmt: skip
        print(
            f"{name:<15} {layout.label():<28} {got / 2**20:7.1f} MiB measured, "
            f"{host.peak / 2**20:7.1f} predicted ({host.phase}) {host.peak / got - 1:+.1%}  "
            f"load {load}",
            flush=True,
        )
    with open(out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    return rows


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""

    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def predicted(model_cfg: dict, layout: Layout, hw) -> dict:
    """The planner's figures for one measured layout (fp32 on CPU ranks)."""
    from meshtrain.plan.calibrate import planner_for

    planner = planner_for(model_cfg, hw, layout.world, SEQ, layout.global_batch)
    why = planner.refusal(layout)
    if why is not None:
        raise SystemExit(f"{layout.label()}: refused: {why}")
    p = planner.predict(layout)
    return {
        "states": p.memory.states.total,
        "tensors": p.memory.tensors,
        "step_s": p.time.total,
    }


def repredict(path: str) -> None:
    """Recompute the predicted columns of a ``measure`` JSON with the calibration stored in
    it (after a change to the models; the measurements stay as they were)."""
    from dataclasses import replace

    from meshtrain.plan.calibration import Calibration
    from meshtrain.plan.hardware import Hardware

    with open(path) as f:
        data = json.load(f)
    cal = Calibration(**data["calibration"])
    hw = replace(cal.apply(Hardware.cpu()), overhead_bytes=0, cores=0)
    for row, (_, cfg, layout) in zip(data["rows"], MEASURED, strict=True):
        assert row["layout"] == layout.label()
        row.update({f"predicted_{k}": v for k, v in predicted(cfg, layout, hw).items()})
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def run_measured(out: str, steps: int = 3) -> None:
    from dataclasses import replace

    from meshtrain.plan.calibrate import calibrate, load_average
    from meshtrain.plan.hardware import Hardware
    from meshtrain.plan.measure import measure

    hw = Hardware.cpu()
    # calibrated now, just before the table: the machine's load moves CPU seconds too
    # (shared cores, caches), so constants fitted an hour earlier under another load
    # would carry that difference into every row
    print(f"calibrating (load {load_average()}):", flush=True)
    cal = calibrate(echo=lambda line: print(line, flush=True))
    # CPU seconds of a rank with its own core (measure's docstring): no oversubscription
    hw = replace(cal.apply(hw), overhead_bytes=0, cores=0)
    rows = []
    for name, cfg, layout in MEASURED:
        load = load_average()
        got = measure(cfg, layout, seq=SEQ, steps=steps)
        pred = predicted(cfg, layout, hw)
        row = {"model": name, "layout": layout.label(), "world": layout.world, "load": load,
               **{f"measured_{k}": v for k, v in got.items()},
               **{f"predicted_{k}": v for k, v in pred.items()}}  # fmt: skip
        rows.append(row)
        print(
            f"{name:<8} {layout.label():<32} {layout.world}  states {got['states']:>10,} / "
            f"{pred['states']:>10,}  peak {got['peak_tensor_bytes'] / 2**20:7.2f} / "
            f"{pred['tensors'] / 2**20:7.2f} MiB  step {got['cpu_s']:.3f} / "
            f"{pred['step_s']:.3f} CPU s ({got['step_s']:.3f} wall)  load {load}",
            flush=True,
        )
    with open(out, "w") as f:
        json.dump(
            {"calibration": cal.__dict__ | {"samples": cal.samples}, "rows": rows}, f, indent=1
        )


def tables(path: str, calibration_labels: set[str] | None = None) -> str:
    """The markdown tables of docs/plan.md from ``run_measured``'s JSON: memory, step time
    (mean absolute error, Spearman), and fit decisions under synthetic caps."""
    from meshtrain.plan.calibrate import LAYOUTS

    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    calib = calibration_labels or {x.label() for x in LAYOUTS}
    mib = 2**20
    out = ["| model | layout | ranks | model states measured / predicted (B) | peak tensor MiB measured / predicted | error | load |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    errs = []
    for r in rows:
        m, p = r["measured_peak_tensor_bytes"], r["predicted_tensors"]
        errs.append(abs(p / m - 1))
        out.append(
            f"| {r['model']} | {r['layout']} | {r['world']} | {r['measured_states']:,} / "
            f"{r['predicted_states']:,} | {m / mib:.2f} / {p / mib:.2f} | {100 * (p / m - 1):+.1f}% "
            f"| {r['load']} |"
        )
    out.append("")
    out.append(f"{len(rows)} layouts; peak tensor memory: mean |error| {100 * statistics.fmean(errs):.1f}%, "
               f"largest {100 * max(errs):.1f}%")  # fmt: skip
    out += ["", "| model | layout | ranks | CPU s measured | predicted | error | wall s | in calibration set | load |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    meas, pred, terr, out_of = [], [], [], []
    for r in rows:
        m, p = r["measured_cpu_s"], r["predicted_step_s"]
        inside = r["model"] == "decoder" and r["layout"] in calib
        meas.append(m)
        pred.append(p)
        terr.append(abs(p / m - 1))
        if not inside:
            out_of.append(abs(p / m - 1))
        out.append(
            f"| {r['model']} | {r['layout']} | {r['world']} | {m:.3f} | {p:.3f} | "
            f"{100 * (p / m - 1):+.1f}% | {r['measured_step_s']:.3f} | "
            f"{'yes' if inside else 'no'} | {r['load']} |"
        )
    out.append("")
    out.append(
        f"{len(rows)} layouts: mean absolute error {100 * statistics.fmean(terr):.1f}% "
        f"({100 * statistics.fmean(out_of):.1f}% on the {len(out_of)} outside the calibration "
        f"set), Spearman rank {spearman(meas, pred):.2f}"
    )
    # fit decisions: synthetic caps between measured peaks (never at one: a cap equal to a
    # measured peak would make that layout a coin toss by construction)
    peaks = sorted({r["measured_peak_tensor_bytes"] for r in rows})
    caps = [(a * b) ** 0.5 for a, b in zip(peaks, peaks[1:], strict=False)][::3]
    agree = total = 0
    wrong = []
    for cap in caps:
        for r in rows:
            total += 1
            fits_m = r["measured_peak_tensor_bytes"] <= cap
            fits_p = r["predicted_tensors"] <= cap
            agree += fits_m == fits_p
            if fits_m != fits_p:
                wrong.append(f"{r['model']} {r['layout']} at a {cap / mib:.1f} MiB cap")
    out += ["", f"fit decisions under {len(caps)} synthetic caps (between measured peaks): "
            f"{agree} of {total} predicted fits agree with the measured ones"
            + (f"; the others: {', '.join(wrong)}" if wrong else "")]  # fmt: skip
    return "\n".join(out)


def user_check(cap_mib: float = 200.0, echo=print) -> dict:
    """A config over a ``--max-memory`` cap on one CPU process: measured over it, advised by
    ``meshtrain plan --config``, and the first advised change measured under it."""
    import os
    import tempfile
    from dataclasses import replace

    from meshtrain.plan.calibrate import load_average, planner_for
    from meshtrain.plan.explain import advice, breakdown, single_changes
    from meshtrain.plan.hardware import Hardware
    from meshtrain.plan.measure import measure

    layout = Layout(dp=1, micro_batch=8, grad_accum=1)
    cap = int(cap_mib * 2**20)
    hw = replace(Hardware.cpu(), overhead_bytes=0)
    planner = planner_for(DECODER, hw, 1, SEQ, layout.global_batch)
    planner.limit = cap
    path = os.path.join(tempfile.mkdtemp(), "my.json")
    with open(path, "w") as f:
        json.dump(layout.config("fp32"), f)
    before = measure(DECODER, layout, seq=SEQ, steps=2)
    echo(f"$ meshtrain plan --gpu cpu --gpus 1 --model decoder:{_spec(DECODER)} --seq {SEQ} "
         f"--max-memory {cap_mib / 1024:.4f} --config my.json")  # fmt: skip
    pred = planner.predict(layout)
    echo(breakdown(pred))
    echo(advice(planner, pred))
    fit = [(w, p) for w, p in single_changes(planner, pred) if p.fits]
    what, chosen = fit[0]
    after = measure(DECODER, chosen.layout, seq=SEQ, steps=2)
    result = {
        "cap_mib": cap_mib, "load": load_average(),
        "measured_before_mib": before["peak_tensor_bytes"] / 2**20,
        "advice": what, "measured_after_mib": after["peak_tensor_bytes"] / 2**20,
    }  # fmt: skip
    echo(f"measured: {layout.label()} peaks at {result['measured_before_mib']:.1f} MiB (> "
         f"{cap_mib:.0f} MiB cap); after '{what}' ({chosen.layout.label()}): "
         f"{result['measured_after_mib']:.1f} MiB (load {result['load']})")  # fmt: skip
    return result


def _spec(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        run_measured(sys.argv[2] if len(sys.argv) > 2 else "plan_measured.json")
    elif sys.argv[1:2] == ["packed"]:
        run_packed(sys.argv[2] if len(sys.argv) > 2 else "plan_packed.json")
    elif sys.argv[1:2] == ["load"]:
        run_load(sys.argv[2] if len(sys.argv) > 2 else "plan_load.json")
    elif sys.argv[1:2] == ["user-check"]:
        user_check()
    elif sys.argv[1:2] == ["repredict"]:
        repredict(sys.argv[2])
    elif sys.argv[1:2] == ["tables"]:
        print(tables(sys.argv[2]))
    elif sys.argv[1:2] == ["published"]:
        predict_published(search="--search" in sys.argv)  # plan.published
    else:
        raise SystemExit(
            "usage: python -m meshtrain.plan.proof measure OUT.json | load OUT.json | packed OUT.json | "
            "published [--search] | tables OUT.json | repredict OUT.json | user-check"
        )
