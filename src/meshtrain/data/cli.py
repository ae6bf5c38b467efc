"""``meshtrain data prepare`` and ``meshtrain data info``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``data`` (with ``prepare`` and ``info``) on the ``meshtrain`` command."""
    parser = subparsers.add_parser(
        "data", help="tokenize data once into a memory-mapped token store"
    )
    sub = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])

    p = sub.add_parser(
        "prepare",
        help="tokenize JSONL/CSV/text files into a token store",
        description="Tokenize inputs with W worker processes into DIR (tokens.bin, offsets.bin, "
        "meta.json). Running it again on the same inputs and options reuses DIR.",
    )
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="JSONL/JSON, CSV/TSV or text files (.gz allowed)"
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="NAME_OR_PATH",
        help="'byte', a save_pretrained folder, a tokenizer.json, or a cached hub name",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="store folder")
    p.add_argument(
        "--text-field",
        default="text",
        metavar="F",
        help="JSON key or CSV column of the text (default: text)",
    )
    p.add_argument(
        "--label-field", default=None, metavar="F", help="optional integer label per row"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="W",
        help="tokenizing processes (default: CPU count)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="L",
        help="row length with --pack; else truncate documents",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="causal-LM packing: documents joined with EOS, cut into L-token rows",
    )
    p.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip and count malformed rows instead of stopping",
    )
    p.add_argument(
        "--add-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tokenizer specials around each document (default: on unless --pack)",
    )
    p.add_argument(
        "--append-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EOS after each document (default: on with --pack)",
    )
    p.add_argument(
        "--force", action="store_true", help="rebuild even if DIR holds the same content"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_prepare)

    info = sub.add_parser("info", help="print a token store's metadata")
    info.add_argument("store", metavar="DIR")
    info.set_defaults(func=_info)
    return parser


def _prepare(args: argparse.Namespace) -> int:
    from meshtrain.data.prepare_store import prepare
    from meshtrain.errors import DataError

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        result = prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            label_field=args.label_field,
            workers=args.workers,
            seq_len=args.seq_len,
            pack=args.pack,
            skip_bad_rows=args.skip_bad_rows,
            add_special_tokens=args.add_special_tokens,
            append_eos=args.append_eos,
            progress=False if args.no_progress else None,
            force=args.force,
        )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


def _info(args: argparse.Namespace) -> int:
    from meshtrain.data.layout import read_meta
    from meshtrain.errors import DataError

    try:
        meta = read_meta(args.store)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(meta, indent=2, sort_keys=True))
    return 0
