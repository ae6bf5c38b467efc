"""meshtrain tensor parallelism vs torch ``parallelize_module`` on the same model, tp 2.

Issue 13's benchmark. Both frameworks shard the reference ``Decoder`` (the PEERS.md
workload: 4 layers, d=256, 4 heads, SwiGLU 688, vocab 1024, 3.69M parameters, fp32,
seed 1234) over 2 ranks (tp 2, dp 1) and train 20 AdamW steps (lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01) on the same global batch of 16 x 32 tokens,
which every rank sees whole (tensor parallelism splits the model, not the batch):

==========  ===============================================================================
name        what
==========  ===============================================================================
meshtrain   ``apply_tensor_parallel`` with the built-in decoder plan: column q/k/v,
            gate/up; row o/down; vocab-parallel embedding, LM head and cross-entropy;
            ``torch.optim.AdamW`` on the local shards
torch       ``parallelize_module`` on ``init_device_mesh("cpu", (2,))``: ColwiseParallel
            q/k/v, gate/up; RowwiseParallel o/down; RowwiseParallel embedding (input
            replicated); ColwiseParallel LM head with ``Shard(-1)`` logits and
            ``loss_parallel()`` (torch's vocab-parallel loss); ``torch.optim.AdamW`` on
            the DTensor parameters
==========  ===============================================================================

The script is both driver and worker: for each repeat the driver launches each framework
in turn (order reversed on odd repeats) with ``torchrun --standalone --nproc_per_node 2``.
samples/s excludes ``--warmup`` steps and uses the slowest rank's clock; peak RSS is the
largest rank's ``VmHWM``. The per-step losses must agree within ``--loss-tol``. Prints
samples/s and peak RSS of each, and the ratios meshtrain/torch (target: samples/s ratio
>= 1.0). Results: ``benchmarks/results/tensor_parallel-<date>-<HHMM>.json``.

    python benchmarks/bench_tensor_parallel.py [--repeats 3] [--steps 20] [--model large]

``--model large`` runs the 69.2M decoder of ``python -m benchmarks`` instead (vocab 8192,
d 768, 8 layers, 12 heads, SwiGLU 2048), the model of issue 12's targets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GLOBAL_BATCH, SEQ_LEN, SEED = 16, 32, 1234
FRAMEWORKS = ("meshtrain", "torch")
ROOT = Path(__file__).resolve().parent
try:  # run as a script (its folder on sys.path) or as benchmarks.bench_tensor_parallel
    from peers import ADAMW, DECODERS, add_model_argument
except ImportError:  # pragma: no cover
    from benchmarks.peers import ADAMW, DECODERS, add_model_argument


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _torch_tp(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"embed": RowwiseParallel(input_layouts=Replicate())}
    for i in range(len(model.layers)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return parallelize_module(model, mesh, plan)


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from meshtrain.models import Decoder, DecoderConfig

    cfg = DECODERS[args.model]
    gen = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, cfg["vocab_size"], (args.steps, GLOBAL_BATCH, SEQ_LEN), generator=gen)
    torch.manual_seed(SEED)
    model = Decoder(DecoderConfig(**cfg, max_seq_len=64, seed=SEED))
    n_params = sum(p.numel() for p in model.parameters())  # the whole model's
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.worker == "meshtrain":
        from meshtrain.distributed.topology import Topology
        from meshtrain.parallel.tensor import apply_tensor_parallel

        topo = Topology(tp=dist.get_world_size())
        model = apply_tensor_parallel(model, topo)

        def train(x):
            loss = model(x, x)
            loss.backward()
            return loss
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = _torch_tp(model, mesh)

        def train(x):
            with loss_parallel():  # the vocab-parallel loss, forward and backward
                loss = model(x, x)
                loss.backward()
            return loss

    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, t0 = [], None
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        loss = train(data[step])
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        losses.append(float(value))
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    rss = torch.tensor([_vm_hwm_mib()])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        timed = args.steps - args.warmup
        Path(args.result).write_text(
            json.dumps(
                {
                    "framework": args.worker,
                    "n_params": n_params,
                    "samples_per_s": timed * GLOBAL_BATCH / float(elapsed),
                    "steps_per_s": timed / float(elapsed),
                    "peak_rss_mib": float(rss),
                    "losses": losses,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _run(name: str, args: argparse.Namespace) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(args.nproc), __file__, "--worker", name,
            "--result", str(result), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--model", args.model,
        ]  # fmt: skip
        for _attempt in range(2):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if result.exists():
                out = json.loads(result.read_text())
                out["exit_code"] = proc.returncode
                return out
            print(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def _versions() -> dict:
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=FRAMEWORKS)
    p.add_argument("--result")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    add_model_argument(p)
    p.add_argument(
        "--loss-tol",
        type=float,
        default=None,
        help="largest |loss difference| allowed. Default 1e-5 for small, 1e-3 for large: "
        "the 69.2M model's losses are about 9, its sums of 768-2048 terms round differently "
        "once split over two ranks, and Adam turns those ~1e-7 relative differences into "
        "lr-sized steps where a gradient is near zero (12 steps measured 8.2e-5)",
    )
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    runs: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    for rep in range(args.repeats):
        for name in FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]:
            out = _run(name, args)
            if out is not None:
                runs[name].append(out)
                print(f"repeat {rep} {name}: {out['samples_per_s']:.1f} samples/s, "
                      f"peak RSS {out['peak_rss_mib']:.0f} MiB")  # fmt: skip
    summary = {}
    for name, rs in runs.items():
        if rs:
            summary[name] = {
                "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
            }
    diff = None
    if runs["meshtrain"] and runs["torch"]:
        a, b = runs["meshtrain"][0]["losses"], runs["torch"][0]["losses"]
        diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
        m, t = summary["meshtrain"], summary["torch"]
        summary["ratio_samples_per_s"] = m["samples_per_s"] / t["samples_per_s"]
        summary["ratio_peak_rss"] = m["peak_rss_mib"] / t["peak_rss_mib"]
        summary["max_loss_diff"] = diff
    print(f"\n{'framework':12}{'samples/s':>12}{'peak RSS MiB':>14}")
    for name in FRAMEWORKS:
        if name in summary:
            s = summary[name]
            print(f"{name:12}{s['samples_per_s']:12.1f}{s['peak_rss_mib']:14.0f}")
    if diff is not None:
        print(f"meshtrain / torch: samples/s {summary['ratio_samples_per_s']:.2f}x, "
              f"peak RSS {summary['ratio_peak_rss']:.2f}x; max |loss diff| {diff:.2e}")  # fmt: skip
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or ROOT / "results" / f"tensor_parallel-{now:%Y-%m-%d-%H%M}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": now.isoformat(), "versions": _versions(),
                               "args": vars(args), "runs": runs, "summary": summary}, indent=1))  # fmt: skip
    print(f"wrote {out}")
    tol = args.loss_tol if args.loss_tol is not None else (1e-5 if args.model == "small" else 1e-3)
    if diff is not None and diff > tol:
        raise SystemExit(f"losses differ by {diff:.2e} > --loss-tol {tol}")


if __name__ == "__main__":
    main()
