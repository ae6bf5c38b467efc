"""``meshtrain plan --calibrate``: measure a handful of layouts on this machine's CPU ranks,
fit the constants of ``calibration.Calibration``, store them.

The layouts (``LAYOUTS``) are chosen so the fit sees each term move on its own: one rank at
two micro-batch sizes (compute and the per-micro-step cost), two ranks under data
parallelism at stage 0 and 2 (gradient bytes), tensor parallelism (per-layer all-reduces)
and a pipeline (bubble, p2p); two runs of a smaller decoder (``SMALL``) separate the
optimizer step's per-parameter cost from the per-step one. The model is a small reference decoder (``MODEL``) at
sequence length ``SEQ``: a few seconds a step at most on a loaded two-core machine.

On GPUs (``meshtrain plan --calibrate --gpu H100``, run on the GPU machine) the same
kinds of layout run on a larger decoder (``GPU_MODEL``, ``GPU_SEQ``, bf16: a step of the
CPU model would be launch-bound and fit nothing but overheads), as many as the GPUs
allow: one GPU measures compute, the per-micro-step and per-step costs and the optimizer
step; with two or more, data, tensor and pipeline parallelism measure the link too.
Ranks never share a GPU (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import replace

from meshtrain.errors import ConfigError
from meshtrain.plan.calibration import Calibration
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.layout import Layout

__all__ = [
    "GPU_MODEL", "GPU_SEQ", "LAYOUTS", "MODEL", "SEQ", "SMALL", "calibrate", "features",
    "gpu_runs", "planner_for",
]  # fmt: skip

MODEL = dict(vocab_size=4224, dim=256, n_layers=4, n_heads=4, ffn_dim=688, max_seq_len=256)
# a second, smaller model: per-parameter costs (the optimizer step) separate from per-step ones
SMALL = dict(vocab_size=2048, dim=128, n_layers=2, n_heads=4, ffn_dim=352, max_seq_len=256)
SEQ = 256
SMALL_LAYOUTS = (
    Layout(dp=1, micro_batch=2, grad_accum=1),
    Layout(dp=1, micro_batch=1, grad_accum=4),
)
LAYOUTS = (
    Layout(dp=1, micro_batch=1, grad_accum=1),
    Layout(dp=1, micro_batch=4, grad_accum=1),
    Layout(dp=1, micro_batch=1, grad_accum=4),
    Layout(dp=2, stage=0, micro_batch=2, grad_accum=1),
    Layout(dp=2, stage=2, micro_batch=1, grad_accum=2),
    Layout(dp=2, stage=3, micro_batch=2, grad_accum=1),
    Layout(dp=1, tp=2, micro_batch=2, grad_accum=1),
    Layout(dp=1, pp=2, micro_batch=1, grad_accum=4),
)

# GPUs: about 0.3 B parameters (a step is ~1e13 FLOPs at micro-batch 4), and a half-width
# one for the per-parameter costs
GPU_MODEL = dict(vocab_size=32768, dim=1024, n_layers=16, n_heads=16, ffn_dim=2816,
                 max_seq_len=2048)  # fmt: skip
GPU_SMALL = dict(vocab_size=32768, dim=512, n_layers=8, n_heads=8, ffn_dim=1408,
                 max_seq_len=2048)  # fmt: skip
GPU_SEQ = 2048


def gpu_runs(n_gpus: int) -> list[tuple[dict, Layout]]:
    """(model, layout) of a GPU calibration on ``n_gpus`` devices (module docstring)."""
    if n_gpus < 1:
        raise ConfigError(
            "--calibrate --gpu: this machine has no CUDA device; calibrate on the GPU "
            "machine itself, or give --gpu cpu to calibrate its CPU ranks"
        )
    one = [x for x in LAYOUTS if x.world == 1]
    runs = [(GPU_MODEL, x) for x in one] + [(GPU_SMALL, x) for x in SMALL_LAYOUTS]
    if n_gpus >= 2:
        runs += [(GPU_MODEL, x) for x in LAYOUTS if x.world == 2]
    return runs


def load_average() -> str:
    """``uptime``'s three load averages."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def planner_for(
    model_cfg: dict, hw: Hardware, world: int, seq: int, global_batch: int,
    precision: str = "fp32", **options,
):  # fmt: skip
    """A planner of ``model_cfg`` (``measure.build_model``) on ``world`` ranks of ``hw``;
    ``options``: further ``Planner`` keywords."""
    from meshtrain.plan.measure import build_model
    from meshtrain.plan.model_facts import ModelFacts
    from meshtrain.plan.planner import Planner

    facts = ModelFacts.of(build_model(model_cfg, meta=True))
    return Planner(
        facts, hw, gpus=world, seq=seq, global_batch=global_batch, limit=hw.memory_bytes,
        precision=precision, optimizer="AdamW", **options,
    )  # fmt: skip


def features(pred) -> dict:
    """The fit's inputs of one prediction made at efficiency 1 and no fixed costs."""
    t = pred.time
    x = pred.layout
    return {
        "layout": x.label(),
        "compute": t.compute + t.bubble,
        "wire": sum(t.comm_bytes.values()),
        "slots": x.grad_accum + x.pp - 1,
        "optimizer": t.optimizer,
    }


def raw_hardware(hw: Hardware) -> Hardware:
    """``hw`` with efficiency 1 and no fixed costs: predictions become the fit's features."""
    return replace(
        hw, efficiency=1.0, micro_step_s=0.0, step_s=0.0, bw_intra=1e30, bw_inter=1e30, hbm=1.0
    )  # the optimizer's time becomes its bytes


def calibrate(
    layouts=LAYOUTS, *, model_cfg: dict = MODEL, seq: int = SEQ, steps: int = 3, save: bool = True,
    echo=print, gpu: str | None = None, runs: list[tuple[dict, Layout]] | None = None,
) -> Calibration:  # fmt: skip
    """Measure ``layouts``, fit, store (module docstring); ``gpu``: a name of
    ``hardware.GPUS``, to calibrate this machine's CUDA devices (``gpu_runs``, bf16)
    instead of its CPU ranks; ``runs``: (model, layout) pairs to measure instead (the GPU
    proof's dry run on CPU)."""
    from meshtrain.plan.measure import measure

    if gpu is None:
        # fitted on CPU seconds (measure's docstring): a rank with a core of its own
        hw = replace(raw_hardware(Hardware.cpu()), cores=0)
        if runs is None:
            runs = [(model_cfg, x) for x in layouts]
            if layouts is LAYOUTS:
                runs += [(SMALL, x) for x in SMALL_LAYOUTS]
        precision, device = "fp32", "cpu"
    else:
        import torch

        device = Hardware.named(gpu).name  # refuses an unknown name first
        if runs is None:
            runs = gpu_runs(torch.cuda.device_count() if torch.cuda.is_available() else 0)
            seq = GPU_SEQ
        hw = raw_hardware(Hardware.named(gpu))
        precision = "bf16"
    rows, rss, overhead = [], 0, 0
    for cfg, x in runs:
        planner = planner_for(cfg, hw, x.world, seq, x.global_batch, precision)
        row = features(planner.predict(x))
        load = load_average()
        got = measure(cfg, x, seq=seq, steps=steps, precision=precision)
        row.update(measured=got["cost_s"], wall=got["step_s"], world=x.world, load=load,
                   model=cfg["dim"])  # fmt: skip
        rss = max(rss, got["rss_base"])
        overhead = max(overhead, got["device_overhead"] or 0)
        rows.append(row)
        unit = "CPU s/step" if device == "cpu" else "s/step"
        echo(
            f"  {row['layout']:<32} {x.world} rank(s)  {got['cost_s']:.3f} {unit} "
            f"({got['step_s']:.3f} s wall, load {load})"
        )
    cal = Calibration.fit(
        rows, hw.peak_flops, device=device, rss_base=rss,
        overhead_bytes=overhead if device != "cpu" else None,
        links_fitted=any(x.world > 1 for _, x in runs),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        load_avg=load_average(),
    )  # fmt: skip
    if save:
        cal.save()
    return cal
