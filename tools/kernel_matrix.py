"""Run the parity tests under every CPU kernel choice this machine offers, and show each
comparison's measured difference beside its bound.

Machines of the same kind select other kernels (AVX2, AVX-512, AMX; MKL's code path; the
thread count that blocks a GEMM), so a tolerance must hold for all of them
(``tests/tolerance.py``). This tool re-runs the parity tests with:

* ``ATEN_CPU_CAPABILITY`` default / avx2 / avx512 (ATen's vectorised kernels: reductions,
  softmax, elementwise; ``default`` also moves small GEMMs off MKL),
* ``MKL_CBWR`` unset / COMPATIBLE (MKL's conditional numerical reproducibility mode: another
  GEMM kernel, standing in for another CPU's MKL code path),
* 1 / 2 intra-op threads, in the test process (``OMP_NUM_THREADS``) and in each spawned rank
  (``MESHTRAIN_TEST_RANK_THREADS``, read by ``tests/harness.py``),

and records every ``tests.tolerance.check`` (``MESHTRAIN_TOLERANCE_LOG``). Usage::

    python tools/kernel_matrix.py                 # the whole matrix, then the table
    python tools/kernel_matrix.py --ci            # one other choice (CI's second pass)
    python tools/kernel_matrix.py --table LOG     # the table of an earlier run's log

The table lists, per comparison, the largest measured difference of each combination,
the bound, and the ratio; ``--out FILE`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The parity tests: every comparison of two computations that reduce in another order.
PARITY_TESTS = [
    "tests/distributed/test_tensor_parallel_engine.py",
    "tests/loss/test_chunked_head.py",
    "tests/trainer/test_packing_trainer.py",
    "tests/distributed/test_engine_dp.py",
    "tests/distributed/test_zero1.py",
    "tests/distributed/test_zero23.py",
    "tests/distributed/test_context_parallel.py",
    "tests/distributed/test_moe.py",
    "tests/distributed/test_pipeline_engine.py",
    "tests/distributed/test_pipeline_module.py",
    "tests/distributed/test_tensor_parallel_models.py",
    "tests/distributed/test_tensor_parallel_ops.py",
    "tests/trainer/test_parity.py",
    "tests/accelerate/test_accelerator.py",
    "tests/accelerate/test_grad_contract.py",
    "tests/loss/test_chunked_cross_entropy.py",
    "tests/data/test_packing.py",
    "tests/test_tolerance.py",
]

# (ATEN_CPU_CAPABILITY, MKL_CBWR, threads in the test process, threads per rank)
MATRIX = [
    ("avx512", "", 1, 1),
    ("avx2", "", 1, 1),
    ("default", "", 1, 1),
    ("avx512", "COMPATIBLE", 1, 1),
    ("avx512", "", 2, 2),
    ("avx2", "COMPATIBLE", 2, 2),
    ("default", "", 2, 2),
    ("default", "COMPATIBLE", 1, 2),
]
CI_COMBO = ("avx2", "COMPATIBLE", 1, 2)  # the suite itself runs at the machine's default


def combo_name(combo) -> str:
    cap, cbwr, omp, rank = combo
    return f"{cap}/{cbwr or '-'}/{omp}/{rank}"


def run(combo, tests: list[str], log: Path) -> int:
    cap, cbwr, omp, rank = combo
    env = dict(os.environ)
    env.update(
        ATEN_CPU_CAPABILITY=cap,
        OMP_NUM_THREADS=str(omp),
        MESHTRAIN_TEST_RANK_THREADS=str(rank),
        MESHTRAIN_TOLERANCE_LOG=str(log),
    )
    env.pop("MKL_CBWR", None)
    if cbwr:
        env["MKL_CBWR"] = cbwr
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    print(f"kernel matrix: {combo_name(combo)}: exit {rc} in {time.monotonic() - start:.0f} s")
    return rc


def table(log: Path) -> dict:
    """{comparison: {"bound": b, "measured": {combo: worst}}} from a tolerance log."""
    out: dict = collections.defaultdict(lambda: {"bound": 0.0, "measured": {}})
    for line in log.read_text().splitlines():
        row = json.loads(line)
        env = row["env"]
        combo = "/".join(
            [
                env["ATEN_CPU_CAPABILITY"] or row["capability"].lower(),
                env["MKL_CBWR"] or "-",
                env["OMP_NUM_THREADS"] or "?",
                env["MESHTRAIN_TEST_RANK_THREADS"] or "1",
            ]
        )
        key = f"{row['test'].split('::')[-1]} | {row['what']}"
        entry = out[key]
        entry["bound"] = max(entry["bound"], row["bound"])
        entry["measured"][combo] = max(entry["measured"].get(combo, 0.0), row["measured"])
    return dict(out)


def show(rows: dict, worst: int | None = None) -> None:
    def ratio(entry):
        return max(entry["measured"].values()) / entry["bound"] if entry["bound"] else 0.0

    items = sorted(rows.items(), key=lambda kv: -ratio(kv[1]))
    if worst:
        items = items[:worst]
    for key, entry in items:
        top = max(entry["measured"].values())
        print(f"{ratio(entry):6.3f}  measured {top:.2e}  bound {entry['bound']:.2e}  {key[:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="one other kernel choice: CI's pass")
    parser.add_argument("--table", type=Path, help="only print the table of this log")
    parser.add_argument("--log", type=Path, default=Path("kernel-matrix.jsonl"))
    parser.add_argument("--out", type=Path, help="write the table as JSON here")
    parser.add_argument("--worst", type=int, default=40, help="rows to print (largest ratio)")
    parser.add_argument("tests", nargs="*", help="test files (default: the parity tests)")
    args = parser.parse_args(argv)
    if args.table:
        rows = table(args.table)
    else:
        tests = args.tests or PARITY_TESTS
        if args.log.exists():
            args.log.unlink()
        rcs = [run(combo, tests, args.log) for combo in ([CI_COMBO] if args.ci else MATRIX)]
        rows = table(args.log) if args.log.exists() else {}
        if any(rcs):
            show(rows, args.worst)
            return max(rcs)
    show(rows, args.worst)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
