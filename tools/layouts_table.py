"""Write docs/layouts.md from the layout matrix (``tests/layouts/matrix.py``): every
combination of pp, dp/ZeRO, tp/SP, cp and ep on up to 8 ranks for the Decoder, Llama and
Mixtral, what trains and what is refused with its reason, as the engine's own checks say
(``meshtrain.plan.validity.LayoutCheck`` on the meta-device models). Usage::

    python tools/layouts_table.py          # rewrite docs/layouts.md
    python tools/layouts_table.py --check  # exit 1 when docs/layouts.md is stale

``tests/layouts/test_matrix.py`` compares the committed file with the same output, so the
docs cannot drift from the engine: lift a refusal, rerun this, commit both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "layouts.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.layouts.matrix import MODELS, counts, render, table

    tables = {name: table(name) for name in MODELS}
    text = render(tables)
    for name, rows in tables.items():
        n_train, why = counts(rows)
        print(f"{name}: {len(rows)} combinations, {n_train} train, {sum(why.values())} refused")
        for reason, n in why.most_common():
            print(f"  {n:4d}  {reason[:110]}")
    if args.check:
        stale = not DOC.exists() or DOC.read_text(encoding="utf-8") != text
        print("docs/layouts.md is stale" if stale else "docs/layouts.md is current")
        return 1 if stale else 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
