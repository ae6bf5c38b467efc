"""Move the lock forward on purpose: newest allowed versions, a scratch environment, the suite.

    python tools/upgrade_lock.py                 # report only
    python tools/upgrade_lock.py --write         # also rewrite requirements/lock.txt if green
    python tools/upgrade_lock.py -- tests/trainer -x   # pass arguments on to pytest

1. Makes a fresh virtual environment in a scratch folder (``--workdir``, default a new
   temporary folder) and installs ``-e ".[dev]"`` there WITHOUT the lock, so pip resolves
   the newest versions pyproject's ranges allow (a machine-wide pip constraint still
   applies: on the development machines torch is capped at the build on disk).
2. Prints every version that differs from ``requirements/lock.txt``.
3. Runs the suite with that environment's interpreter and lists the tests that failed.
4. With ``--write`` and a green suite, writes the new pins to ``requirements/lock.txt``;
   the upgrade is then a commit like any other, and CI proves it.

Exit status: pytest's (0 only when the suite passed with the new versions).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import venv
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
HEADER_LINES = 4  # the comment block at the top of the lock


def pins(text: str) -> dict[str, str]:
    """``{name: version}`` of the ``name==version`` lines (comments and editables skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package added, removed or moved between two pin sets."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a != b:
            lines.append(f"  {name}: {a or '(none)'} -> {b or '(removed)'}")
    return lines


def failed_tests(junit: Path) -> list[str]:
    """``file::test`` of every failed or errored test case in a junit XML report."""
    if not junit.exists():
        return []
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch folder (default: new temp dir)"
    )
    parser.add_argument("--write", action="store_true", help="rewrite the lock if the suite passes")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="meshtrain-upgrade-"))
    work.mkdir(parents=True, exist_ok=True)
    env_dir = work / "venv"
    print(f"[upgrade] fresh environment in {env_dir}", flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "-e", ".[dev]"], cwd=ROOT, check=True)
    frozen = subprocess.run(
        [py, "-m", "pip", "freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    new = pins(frozen)
    (work / "lock.new.txt").write_text(frozen)
    moved = changes(pins(LOCK.read_text()), new)
    print(
        "[upgrade] versions that differ from the lock:" if moved else "[upgrade] no version moved"
    )
    print("\n".join(moved), flush=True)
    junit = work / "junit.xml"
    rc = subprocess.run(
        [py, "-m", "pytest", "-q", f"--junitxml={junit}", *args.pytest_args], cwd=ROOT
    ).returncode
    broken = failed_tests(junit)
    if broken:
        print(f"[upgrade] {len(broken)} test(s) broke with the new versions:")
        print("\n".join(f"  {t}" for t in broken))
    elif rc == 0:
        print("[upgrade] the suite passed with the new versions")
    if args.write:
        if rc != 0:
            print("[upgrade] lock NOT written: the suite did not pass", file=sys.stderr)
        else:
            header = "".join(LOCK.read_text().splitlines(keepends=True)[:HEADER_LINES])
            LOCK.write_text(header + "".join(f"{n}=={v}\n" for n, v in sorted(new.items())))
            print(f"[upgrade] wrote {LOCK.relative_to(ROOT)}; commit it with the suite's result")
    return rc


if __name__ == "__main__":
    sys.exit(main())
