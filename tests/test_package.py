"""Packaging promises: a light import and a working command line."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_pull_heavy_extras():
    code = (
        "import sys, meshtrain; "
        "heavy = [m for m in ('transformers', 'datasets', 'fastapi', 'uvicorn', 'peft', "
        "'tokenizers', 'torch') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
    # the import-time report lists every module imported; none of the extras appear
    assert "transformers" not in out.stderr and "fastapi" not in out.stderr


def test_cli_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "meshtrain", "--help"], capture_output=True, text=True, check=True
    )
    assert "launch" in out.stdout
