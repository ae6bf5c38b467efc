"""Run a user-style script as its author wrote it (for the peer) and with the import
changed (for meshtrain), and compare what a user would look at.

A script in this folder is ours, written the way the peers' published examples are
(accelerate's ``examples/``, transformers' ``examples/pytorch``), never copied. The line
that names the peer's front door ends with ``# peer-import``; for meshtrain the runner
writes a copy of the script with the peer's package name in that line (and only there)
replaced by ``meshtrain``. Everything else, other imports from the peer included
(``transformers.AutoConfig``, ``HfArgumentParser``, ...), stays as written.

A case is one or more invocations (a resume runs the script twice) on 1 or 2 CPU
processes (``torch.distributed.run``), offline, with ``ACCELERATE_USE_CPU=true`` (what
``accelerate launch --cpu`` exports: without it accelerate 1.15 on a CPU machine runs each
torchrun process alone, every one printing and writing as a main process). Compared, in this order:

* each invocation's exit code;
* the lines the script prints that start with one of the case's ``prefixes`` (its metric
  lines), number by number within ``rtol`` / ``atol`` plus one unit of the number's last
  printed place (``_printed_unit``), the rest of each line exactly (a
  line naming a wall-clock value, such as ``train_runtime``, by its text before ``=``);
* the files under the output folder: the same relative paths (digits of time-named
  folders and event-file suffixes masked), the JSON files' contents (numbers within the
  tolerance; keys named ``*runtime*`` / ``*per_second*`` and wall-clock values skipped);
* the final weights: every ``*.safetensors`` file under the output folder, tensor by
  tensor within the tolerance.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parents[2]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
TIMED = ("runtime", "per_second", "total_flos", "time")


@dataclass
class Case:
    """One script run as a user would: ``invocations`` (lists of arguments; ``{out}`` is
    the output folder) on ``nproc`` processes, and what of its output is compared."""

    script: str
    nproc: int = 2
    invocations: list[list[str]] = field(default_factory=lambda: [[]])
    prefixes: tuple[str, ...] = ("epoch", "step", "eval", "fold", "***", "  ")
    rtol: float = 1e-5
    atol: float = 1e-6
    env: dict[str, str] = field(default_factory=dict)
    # output paths (by prefix, or a file name anywhere) that one side alone writes on
    # purpose (save_state: meshtrain writes no pickles, docs/compatibility.md); their
    # contents are still read by the script
    ignore: tuple[str, ...] = ()


@dataclass
class Run:
    codes: list[int]
    lines: list[str]
    files: list[str]
    json: dict[str, object]
    weights: dict[str, dict]
    stderr: str


def with_import_changed(text: str, impl: str) -> str:
    """The script for ``impl``: as written for the peer, or with the marked line's peer
    package replaced by ``meshtrain``."""
    if impl == "peer":
        return text
    out = []
    for line in text.splitlines(keepends=True):
        if line.rstrip().endswith("# peer-import"):
            line = re.sub(r"\b(accelerate|transformers|deepspeed)\b", "meshtrain", line, count=1)
        out.append(line)
    changed = "".join(out)
    assert changed != text, "the script has no '# peer-import' line"
    return changed


def run(case: Case, impl: str, workdir: Path) -> Run:
    """Run ``case`` for ``impl`` ("peer" or "meshtrain") in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / Path(case.script).name
    script.write_text(with_import_changed((HERE / case.script).read_text(), impl))
    out = workdir / "out"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "ACCELERATE_USE_CPU": "true",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
        **case.env,
    }
    codes, lines, err = [], [], []
    for args in case.invocations:
        args = [a.replace("{out}", str(out)) for a in args]
        if case.nproc == 1:
            cmd = [sys.executable, str(script), *args]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={case.nproc}",
                str(script),
                *args,
            ]
        proc = subprocess.run(
            cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600
        )
        codes.append(proc.returncode)
        lines += [ln for ln in proc.stdout.splitlines() if ln.startswith(case.prefixes)]
        err.append(proc.stderr[-4000:])
    files, blobs, weights = _outputs(out, case.ignore)
    return Run(codes, lines, files, blobs, weights, "\n".join(err))


def _mask(rel: str) -> str:
    rel = re.sub(r"\d{9,}\.\d+", "<time>", rel)
    return re.sub(r"events\.out\.tfevents\..*", "events", rel)


def _outputs(out: Path, ignore: tuple[str, ...]):
    from safetensors.torch import load_file

    files, blobs, weights = [], {}, {}
    if out.exists():
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            rel = _mask(str(path.relative_to(out)))
            if rel.startswith(ignore) or path.name in ignore:
                continue
            files.append(rel)
            if path.suffix == ".json":
                blobs[rel] = json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                weights[rel] = load_file(str(path))
    return sorted(files), blobs, weights


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)


def _printed_unit(text: str) -> float:
    """One unit in the last printed place of a number (``5.6354`` -> 1e-4): two values
    within the tolerance may round to neighbouring printed values (5.63545 and 5.63549
    print as 5.6354 and 5.6355); the JSON files keep the full values, compared without it.
    An integer is exact (0)."""
    if "." not in text and "e" not in text.lower():
        return 0.0  # an integer (a count, a step) is printed exactly
    mantissa = text.lower().split("e")[0]
    places = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(text.lower().split("e")[1]) if "e" in text.lower() else 0
    return 10.0 ** (exponent - places)


def _same_json(a, b, rtol, atol, key="") -> list[str]:
    if any(t in key for t in TIMED):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{key}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in _same_json(a[k], b[k], rtol, atol, k)]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{key}: {len(a)} items != {len(b)}"]
        return [d for x, y in zip(a, b, strict=True) for d in _same_json(x, y, rtol, atol, key)]
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return [] if _close(a, b, rtol, atol) else [f"{key}: {a} != {b}"]
    return [] if a == b else [f"{key}: {a!r} != {b!r}"]


def compare(case: Case, peer: Run, ours: Run) -> list[str]:
    """Every difference between the two runs (empty when they match)."""
    diffs = []
    if peer.codes != ours.codes:
        diffs.append(f"exit codes {peer.codes} != {ours.codes}\n{ours.stderr}")
    if len(peer.lines) != len(ours.lines):
        diffs.append(f"printed {len(peer.lines)} metric lines, meshtrain {len(ours.lines)}")
    for a, b in zip(peer.lines, ours.lines, strict=False):
        if any(t in a for t in TIMED):  # a wall-clock value: its width varies too
            if a.split("=")[0] != b.split("=")[0]:
                diffs.append(f"line {a!r} != {b!r}")
            continue
        na, nb = NUMBER.findall(a), NUMBER.findall(b)
        if NUMBER.sub("#", a) != NUMBER.sub("#", b) or len(na) != len(nb):
            diffs.append(f"line {a!r} != {b!r}")
        elif not all(
            _close(float(x), float(y), case.rtol, case.atol + _printed_unit(x))
            for x, y in zip(na, nb, strict=True)
        ):
            diffs.append(f"line {a!r} != {b!r}")
    if peer.files != ours.files:
        diffs.append(f"files {peer.files} != {ours.files}")
    for rel in peer.json.keys() & ours.json.keys():
        diffs += [
            f"{rel}: {d}" for d in _same_json(peer.json[rel], ours.json[rel], case.rtol, case.atol)
        ]
    for rel in peer.weights.keys() & ours.weights.keys():
        a, b = peer.weights[rel], ours.weights[rel]
        if a.keys() != b.keys():
            diffs.append(f"{rel}: tensors {sorted(a)} != {sorted(b)}")
            continue
        for k in a:
            gap = (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0
            if gap > case.atol + case.rtol * a[k].double().abs().max().item():
                diffs.append(f"{rel}:{k} differs by {gap:.3e}")
    return diffs


__all__ = ["Case", "Run", "compare", "run", "with_import_changed"]
