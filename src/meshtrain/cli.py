"""The ``meshtrain`` command.

Each subcommand lives in the module that owns the feature and exposes
``add_parser(subparsers)`` which registers its parser and sets ``func`` on it. The modules
are imported only when the command line is parsed, so ``import meshtrain`` stays light.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_parser(subparsers). A module that is not there yet
# (features land issue by issue) is simply not offered.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("launch", "meshtrain.launch.cli"),
    ("train", "meshtrain.jobs.train.main_job"),
    ("estimate", "meshtrain.estimate.cli"),
    ("plan", "meshtrain.plan.cli"),
    ("consolidate", "meshtrain.interop.consolidate_command"),
    ("data", "meshtrain.data.cli"),
    ("serve", "meshtrain.serve.cli"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshtrain",
        description="Distributed training on torch.distributed: one engine, any layout.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module_name in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("meshtrain"):
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
