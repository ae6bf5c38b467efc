"""``meshtrain consolidate``: the command line over ``checkpoint.consolidate`` (the
streamed export) and ``interop.merge_lora`` (a LoRA checkpoint merged into its base)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.consolidate import consolidate
from meshtrain.dtypes import PRECISIONS
from meshtrain.errors import CheckpointError
from meshtrain.interop.merge_lora import consolidate_merged


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _main(args: argparse.Namespace) -> int:
    try:
        if args.merge_lora:  # a LoRA checkpoint merged into its base (merge_lora.py)
            out = consolidate_merged(args.checkpoint, args.output, args.merge_lora, tag=args.tag)
        else:
            out = consolidate(args.checkpoint, args.output, tag=args.tag, dtype=args.dtype)
    except CheckpointError as exc:
        print(f"meshtrain consolidate: error: {exc}", file=sys.stderr)
        return 1
    print(f"{out} ({_human(_size(out))})")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``meshtrain consolidate CHECKPOINT_DIR OUTPUT [--tag T] [--dtype D]``."""
    p = subparsers.add_parser(
        "consolidate",
        help="export a sharded checkpoint as one safetensors file or a save_pretrained folder",
        description="Stream a sharded meshtrain checkpoint into one safetensors file "
        "(OUTPUT ends in .safetensors) or a folder (model.safetensors, plus config.json "
        "for transformers models, loadable with from_pretrained). Memory stays at one "
        "chunk of one tensor, whatever the model size.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="save_dir (uses its 'latest' unless --tag) or one tag directory",
    )
    p.add_argument("output", metavar="OUTPUT", help="FILE.safetensors or a folder")
    p.add_argument("--tag", default=None, metavar="T", help="checkpoint tag in CHECKPOINT_DIR")
    p.add_argument(
        "--dtype",
        default=None,
        choices=sorted(PRECISIONS),
        help="cast floating tensors (default: the model dtype in the checkpoint)",
    )
    p.add_argument(
        "--merge-lora",
        default=None,
        metavar="ADAPTER_CONFIG",
        help="merge the checkpoint's LoRA adapter (peft) into the base weights, scaled as "
        "ADAPTER_CONFIG (adapter_config.json or its folder) says; OUTPUT is a folder",
    )
    p.set_defaults(func=_main)
    return p
