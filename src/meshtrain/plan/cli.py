"""``meshtrain plan``: from a model and the hardware to the layout that fits and runs
fastest (``--model``), or what a given config needs (``--config``); ``--calibrate`` fits
this machine's constants first. See docs/plan.md."""

from __future__ import annotations

import argparse
import json
import sys

from meshtrain.errors import ConfigError

__all__ = ["add_parser"]

GiB = 1 << 30


def _hardware(args):
    from meshtrain.plan.calibration import Calibration
    from meshtrain.plan.hardware import Hardware

    if args.nodes < 1 or args.gpus % args.nodes:
        raise ConfigError(
            f"--nodes: {args.nodes} must be >= 1 and divide --gpus {args.gpus} (devices per node)"
        )
    from dataclasses import replace

    hw = Hardware.named(args.gpu, gpus_per_node=args.gpus // args.nodes)
    # this machine's calibration of that device, where one was stored (--calibrate)
    cal = Calibration.load(device=hw.name)
    if cal is not None:
        hw = replace(cal.apply(hw), gpus_per_node=args.gpus // args.nodes)
    return hw.with_links(args.bw_intra, args.bw_inter)


def _calibration_device(gpu: str | None) -> str | None:
    """What ``--calibrate`` measures: None for CPU ranks, else the GPU's name. Without
    ``--gpu``: this machine's GPUs when CUDA is present (named from the device)."""
    if gpu is not None:
        return None if gpu.lower() == "cpu" else gpu
    import torch

    if not torch.cuda.is_available():
        return None
    from meshtrain.plan.hardware import GPUS

    name = torch.cuda.get_device_name(0)
    known = [k for k in GPUS if k in name.upper()]
    if not known:
        raise ConfigError(
            f"--gpu: this machine's GPU {name!r} has no data-sheet entry; name the nearest "
            f"of {', '.join(GPUS)} with --gpu, or give --gpu cpu"
        )
    return known[0]


def _planner(args, facts, hw, precision, optimizer):
    from meshtrain.plan.planner import Planner

    seq = args.seq or facts.max_seq or 2048
    limit = int(args.max_memory * GiB) if args.max_memory else hw.memory_bytes
    if args.gpu.lower() == "cpu" and not args.max_memory:
        limit = hw.memory_bytes // args.gpus
    batch = args.global_batch or 4 * args.gpus
    return Planner(
        facts, hw, gpus=args.gpus, seq=seq, global_batch=batch, limit=limit,
        precision=precision, optimizer=optimizer, packed=args.packed, padding=args.padding,
        loading=args.loading,
    )  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except ConfigError as exc:
        print(f"meshtrain plan: error: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    from meshtrain.plan.model_facts import ModelFacts, load_model
    from meshtrain.plan.report import nothing_fits, ranked_table, why_line

    if args.calibrate:
        from meshtrain.plan.calibrate import calibrate

        gpu = _calibration_device(args.gpu)
        where = "CPU ranks" if gpu is None else f"{gpu} GPUs"
        print(f"calibrating on this machine's {where} (a few steps of each layout):")
        cal = calibrate(gpu=gpu)
        args.gpu = args.gpu or gpu  # plan for the device just calibrated
        print(
            f"fitted: efficiency {cal.efficiency:.3f} of {cal.peak_flops / 1e9:.1f} GFLOP/s, "
            f"bandwidth {cal.bw_intra / 1e9:.3f} GB/s, {cal.micro_step_s * 1e3:.1f} ms per "
            f"micro-step, {cal.step_s * 1e3:.1f} ms per step; stored in {cal.path()}"
        )
        if args.model is None:
            return 0
    args.gpu = args.gpu or "H100"
    if args.model is None:
        raise ConfigError("--model: give the model to plan (hf:PATH, decoder:SPEC or a .json)")
    if args.gpus is None:
        raise ConfigError("--gpus: give the number of devices to plan for")
    facts = ModelFacts.of(load_model(args.model))
    hw = _hardware(args)
    precision = args.precision or ("fp32" if hw.name == "cpu" else "bf16")
    if args.config:
        return _explain(args, facts, hw, precision)
    planner = _planner(args, facts, hw, precision, args.optimizer)
    preds = planner.ranked()
    print(
        f"meshtrain plan: {facts.family} {facts.params / 1e9:.3g}B parameters"
        + (f" ({facts.n_experts} experts, top {facts.top_k})" if facts.moe else "")
        + f" on {args.gpus} x {hw.name} ({args.nodes} node(s)), seq {planner.seq}, global "
        f"batch {planner.global_batch}, {precision}, limit {planner.limit / GiB:.1f} GiB"
    )
    print(
        f"device: {hw.peak_flops / 1e12:.4g} TFLOP/s x efficiency {hw.efficiency:.2f}, links "
        f"{hw.bw_intra / 1e9:.4g} / {hw.bw_inter / 1e9:.4g} GB/s ({hw.source})"
    )
    refused = sum(planner.refused.values())
    print(f"{len(preds)} layouts predicted, {refused} refused by meshtrain's checks")
    for why, n in planner.refused.most_common(3):
        print(f"  refused x{n}: {why}")
    print()
    print(ranked_table(preds, args.top))
    print()
    if not any(p.fits for p in preds):
        print(nothing_fits(preds, planner.limit, args.gpus))
        return 1
    print(why_line(preds))
    win = next(p for p in preds if p.fits)
    config = win.layout.config(precision, args.optimizer)
    text = json.dumps(config, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"winner written to {args.out}: meshtrain.initialize(config={args.out!r}) or "
              f"meshtrain train --config {args.out} --nproc {args.gpus}")  # fmt: skip
    else:
        print(text)
    return 0


def _explain(args, facts, hw, precision) -> int:
    from meshtrain.config import load_config
    from meshtrain.plan.explain import advice, breakdown
    from meshtrain.plan.layout import Layout

    config = load_config(args.config)
    precision = config.precision
    optimizer = config.optimizer.type if config.optimizer else args.optimizer
    planner = _planner(args, facts, hw, precision, optimizer)
    layout = Layout.from_config(config, args.gpus).but(packed=args.packed)
    why = planner.refusal(layout)
    if why is not None:
        raise ConfigError(f"--config {args.config}: meshtrain refuses this layout: {why}")
    pred = planner.predict(layout)
    print(breakdown(pred))
    print(advice(planner, pred))
    return 0 if pred.fits else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``meshtrain plan`` on the top-level ``meshtrain`` command."""
    from meshtrain.plan.hardware import GPUS

    p = subparsers.add_parser(
        "plan",
        help="the layout that fits and runs fastest for a model on N devices",
        description="Enumerate every layout meshtrain runs (dp/ZeRO/offload, tp +- SP, pp and "
        "schedule, cp and method, ep, micro-batch, activation checkpointing), predict each "
        "one's memory and step time, and print them ranked with the winner's config. "
        "See docs/plan.md.",
    )
    p.add_argument(
        "--model", metavar="SPEC", help="hf:PATH, decoder:KEY=VALUE,... or a config .json"
    )
    p.add_argument("--gpus", type=int, metavar="N", help="devices in all")
    p.add_argument(
        "--gpu",
        default=None,
        help=f"device kind: {', '.join(GPUS)} or cpu (default H100; with --calibrate: "
        "this machine's GPUs if it has any, else its CPU ranks)",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step (default 4 x --gpus)"
    )
    p.add_argument(
        "--max-memory", type=float, default=None, metavar="GiB",
        help="memory per device (default: the device's; cpu: host memory / --gpus)",
    )  # fmt: skip
    p.add_argument("--bw-intra", type=float, default=None, metavar="GB/s", help="link in a node")
    p.add_argument(
        "--bw-inter", type=float, default=None, metavar="GB/s", help="link between nodes"
    )
    p.add_argument("--precision", default=None, help="bf16 (default on GPUs), fp16 or fp32 (cpu)")
    p.add_argument("--optimizer", default="AdamW", help="optimizer type (default AdamW)")
    p.add_argument("--top", type=int, default=12, help="rows of the table (default 12)")
    p.add_argument("--out", metavar="FILE", help="write the winner's config here")
    p.add_argument(
        "--loading",
        default="whole",
        choices=("whole", "sliced", "zero-init"),
        help="how the script loads the model, for host RAM while loading (docs/plan.md): "
        "whole (built in every process, the default), sliced (meshtrain.from_pretrained("
        "folder, config=...): each rank reads its slices), zero-init (built under "
        "meshtrain.zero.Init: ZeRO-3 only)",
    )
    p.add_argument(
        "--packed", action="store_true",
        help="the rows are packed (several documents each, docs/packing.md): count their masks",
    )  # fmt: skip
    p.add_argument(
        "--padding", type=float, default=None, metavar="F",
        help="the padded share of unpacked rows (PackedDataset.stats() tells): search packed "
        "and padded rows, counting data tokens only",
    )  # fmt: skip
    p.add_argument(
        "--config",
        metavar="FILE",
        help="explain this config instead: memory and the changes that fit",
    )
    p.add_argument(
        "--calibrate", action="store_true",
        help="measure a few layouts on this machine's CPU ranks and store the fitted constants",
    )  # fmt: skip
    p.set_defaults(func=_run)
    return p
