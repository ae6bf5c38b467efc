"""The reproducible install: README, CI and the lock agree, and the upgrade tool's parts work.

A fresh install must resolve to the versions the suite last passed with, so the README's
install command and ``.ci/run`` both name ``requirements/lock.txt``, the lock pins every
package that ``pyproject.toml`` asks for, and the README keeps exactly two set-up commands.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import upgrade_lock  # noqa: E402

INSTALL = 'pip install -c requirements/lock.txt -e ".[dev]"'


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up and test", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def test_readme_and_ci_install_from_the_lock():
    assert _setup_commands() == [INSTALL, "pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert INSTALL in ci and "\npytest\n" in ci


def _requirement_names() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"])
    for extra in meta["optional-dependencies"].values():
        reqs += extra
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}
    return names - {"meshtrain"}


def test_the_lock_pins_every_dependency_exactly():
    pinned = upgrade_lock.pins((ROOT / "requirements" / "lock.txt").read_text())
    missing = sorted(_requirement_names() - pinned.keys())
    assert not missing, f"requirements/lock.txt pins no version of {missing}"
    ranges = (ROOT / "pyproject.toml").read_text()
    assert "==" not in ranges.split("[project.optional-dependencies]")[0], "pyproject pins exactly"


def test_upgrade_tool_reports_moves_and_failures(tmp_path):
    old = upgrade_lock.pins("# header\ntorch==2.14.1\nTransformers==5.23.0\nsix==1.0\n")
    new = upgrade_lock.pins("torch==2.14.1\ntransformers==5.24.0\nxxhash==4.1.0\n")
    assert upgrade_lock.changes(old, new) == [
        "  six: 1.0 -> (removed)",
        "  transformers: 5.23.0 -> 5.24.0",
        "  xxhash: (none) -> 4.1.0",
    ]
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="ok"/>'
        '<testcase classname="tests.a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="err"><error message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert upgrade_lock.failed_tests(junit) == ["tests.a::bad", "tests.b::err"]
