"""Roles whose runs are the standalone benchmarks' own, for ``python -m benchmarks``.

Tensor parallelism, the pipeline schedules, the Trainer and the Accelerator each have a
benchmark script with its own workload and peer set-up (``bench_tensor_parallel.py``,
``bench_pipeline.py``, ``bench_trainer.py``, ``bench_accelerate.py``). Rather than a second
copy of those set-ups in ``peers.setup``, the suite calls the scripts' own launch functions:
``RUNNERS[framework](nproc, steps, quick, tmp)`` runs one framework once, in fresh
processes, and returns ``samples_per_s`` and ``peak_rss_mib`` (the larger rank's), which
the suite pairs, tables and charts like every other role. The workloads are the scripts'
(see their docstrings): TP and PP (``DECODER``) train the suite's decoder at tp 2 / pp 2 with
a global batch of 16 (the 69.2M one in full mode, the 3.7M one with ``--quick``), the
Trainer a 2-layer BERT classifier, the Accelerator the MNIST BasicNet.
"""

from __future__ import annotations

import argparse
import resource


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model(quick: bool) -> str:
    return "small" if quick else "large"


def _tp(name: str):
    def run(nproc: int, steps: int, quick: bool, tmp: str) -> dict | None:
        from benchmarks import bench_tensor_parallel as b

        args = argparse.Namespace(
            nproc=nproc, steps=steps, warmup=1 if quick else 2, model=_model(quick)
        )
        return b._run(name, args)

    return run


def _pipeline_rank(peer: str, steps: int, model: str) -> dict:
    from benchmarks import bench_pipeline as b

    out = b._peer_rank(peer, steps, model_name=model)
    out["rss_mib"] = max(out["rss_mib"], _rss_mib())
    return out


def _pp(peer: str):
    def run(nproc: int, steps: int, quick: bool, tmp: str) -> dict | None:
        from benchmarks import bench_pipeline as b
        from meshtrain.launch.processes import run_on_ranks

        per_rank = run_on_ranks(_pipeline_rank, nproc, (peer, steps, _model(quick)), timeout=900)
        sec = max(r["seconds"] for r in per_rank)
        return {
            "samples_per_s": steps * b.MICRO * b.ROWS / sec,
            "peak_rss_mib": max(r["rss_mib"] for r in per_rank),
            "losses": per_rank[0]["losses"],
            "n_params": per_rank[0]["n_params"],
        }

    return run


def _trainer_rank(peer: str, steps: int, out: str) -> dict:
    from benchmarks import bench_trainer as b

    result = b._worker(peer, steps, out)
    result["rss_mib"] = _rss_mib()
    return result


def _trainer(peer: str):
    def run(nproc: int, steps: int, quick: bool, tmp: str) -> dict | None:
        from benchmarks import bench_trainer as b
        from meshtrain.launch.processes import run_on_ranks

        steps, warmup = max(steps, 12), 2 if quick else 5
        env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        results = run_on_ranks(
            _trainer_rank, nproc, (peer, steps, f"{tmp}/{peer}"), {}, timeout=1200, env=env
        )
        timed = results[0]["stamps"][warmup:]  # (wall, process CPU) seconds at each step end
        step_s = (timed[-1][0] - timed[0][0]) / (len(timed) - 1)
        return {
            "samples_per_s": b.BATCH * nproc / step_s,
            "peak_rss_mib": max(r["rss_mib"] for r in results),
        }

    return run


def _accelerate(backend: str):
    def run(nproc: int, steps: int, quick: bool, tmp: str) -> dict | None:
        from benchmarks import bench_accelerate as b

        args = argparse.Namespace(
            nproc=nproc, model="basic", steps=max(steps, 10), warmup=2 if quick else 3
        )
        return b.run_one(backend, args, tmp, 0)

    return run


# frameworks whose workload is the suite's decoder (69.2M in full mode, 3.7M with --quick)
DECODER = ("mt-tp", "torch-tp", "mt-gpipe", "torch-gpipe", "mt-1f1b", "torch-1f1b")
RUNNERS = {
    "mt-tp": _tp("meshtrain"),
    "torch-tp": _tp("torch"),
    "mt-gpipe": _pp("meshtrain-gpipe"),
    "torch-gpipe": _pp("torch-gpipe"),
    "mt-1f1b": _pp("meshtrain-1f1b"),
    "torch-1f1b": _pp("torch-1f1b"),
    "mt-trainer": _trainer("meshtrain"),
    "hf-trainer": _trainer("transformers"),
    "mt-accelerate": _accelerate("meshtrain"),
    "accelerate": _accelerate("accelerate"),
}
