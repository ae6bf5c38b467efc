"""``python -m meshtrain.config --markdown`` prints docs/config.md;
``python -m meshtrain.config FILE [--world-size N]`` validates FILE and prints the resolved config.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshtrain.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshtrain.config", description=__doc__)
    parser.add_argument("file", nargs="?", help="a JSON or YAML config to validate")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--markdown", action="store_true", help="print the config reference")
    args = parser.parse_args(argv)
    if args.markdown:
        from meshtrain.config.reference import config_reference_markdown

        sys.stdout.write(config_reference_markdown())
        return 0
    if not args.file:
        parser.error("give a config FILE or --markdown")
    from meshtrain.config import load_config

    try:
        config = load_config(args.file, world_size=args.world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(config.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
