"""meshtrain's MoE layer vs DeepSpeed's ``deepspeed.moe.layer.MoE``, same experts and ep.

Issue 35's benchmark. One MoE layer (``peers.MOE``: hidden 256, 8 SwiGLU experts of 512,
top-2, dropless) at expert parallelism ``ep`` = the number of ranks (2 by default: each
rank holds 4 experts), trained through each framework's engine at ZeRO-0 with AdamW
(``peers.ADAMW``), fp32, on gloo, one thread per rank:

==========  ===============================================================================
name        what (``peers.moe_setup``)
==========  ===============================================================================
mt-moe      ``meshtrain.models.moe.MoE`` (router, softmax -> top-2 -> renormalise, as
            Mixtral) under ``meshtrain.initialize`` with ``mesh.expert_parallel_size =
            ep``: experts sharded over ep, tokens sent to their experts' ranks by an
            all-to-all with variable splits (dropless, no padding), experts computed by
            a grouped GEMM or a per-expert loop (``parallel.experts.gemm``)
ds-moe      ``deepspeed.moe.layer.MoE(hidden, SwiGLU, num_experts=8, ep_size=ep, k=2,
            drop_tokens=False)`` under ``deepspeed.initialize``: dropless by raising the
            capacity to the largest expert's load, every expert's buffer padded to it
==========  ===============================================================================

Each rank draws its own ``--tokens`` rows of random activations per step (so routing
differs between ranks); the loss is ``mean(layer(x) ** 2)``. The script is both driver and
worker: for each repeat the driver launches each framework in fresh processes (order
reversed on odd repeats) with ``torchrun --standalone --nproc_per_node N``. steps/s
excludes ``--warmup`` steps and uses the slowest rank's clock; peak RSS is the largest
rank's ``VmHWM``; CPU ms/step is the process CPU time per timed step (gloo's threads
included), mean over ranks: on a shared machine the steadier figure. DeepSpeed JIT-compiles a small op on its first run: one untimed warm-up
run of it comes first. Prints steps/s and peak RSS of each and the ratios meshtrain /
DeepSpeed (targets: speed >= 1.0x, RSS <= 1.0x). Results:
``benchmarks/results/moe-<date>-<HHMM>.json``.

    python -m benchmarks.bench_moe [--nproc 2] [--repeats 3] [--steps 20] [--tokens 512]
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

SEED = 1234
ROOT = Path(__file__).resolve().parent
try:  # run as a script (its folder on sys.path) or as benchmarks.bench_moe
    from peers import MOE, MOE_FRAMEWORKS, moe_setup
except ImportError:  # pragma: no cover
    from benchmarks.peers import MOE, MOE_FRAMEWORKS, moe_setup


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    runner = moe_setup(args.worker, ep=world, micro=1, seed=SEED)
    import torch.distributed as dist

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(SEED + rank)  # each rank its own tokens
    data = torch.randn(args.steps, 1, args.tokens, MOE["hidden"], generator=gen)
    losses, t0 = [], None
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
        loss = runner.forward(data[step])
        runner.backward(loss)
        runner.step()
        losses.append(float(loss))
    cpu = torch.tensor([time.process_time() - c0])  # the whole process, gloo's threads too
    dist.all_reduce(cpu)
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
                    "steps_per_s": timed / float(elapsed),
                    "tokens_per_s": timed * world * args.tokens / float(elapsed),
                    "peak_rss_mib": float(rss),
                    "cpu_ms_per_step": 1000 * float(cpu) / world / timed,
                    "losses": losses,
                }
            )
        )
    runner.shutdown()


def _run(name: str, args: argparse.Namespace, steps: int | None = None) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(args.nproc), __file__, "--worker", name,
            "--result", str(result), "--steps", str(steps or args.steps),
            "--warmup", str(args.warmup), "--tokens", str(args.tokens),
        ]  # fmt: skip
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if result.exists():
            out = json.loads(result.read_text())
            out["exit_code"] = proc.returncode
            return out
        print(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def _versions() -> dict:
    import deepspeed
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "commit": commit,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=MOE_FRAMEWORKS)
    p.add_argument("--result")
    p.add_argument("--nproc", type=int, default=2, help="ranks = ep (default 2)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    if _run("ds-moe", args, steps=args.warmup + 1) is None:  # DeepSpeed's JIT op, untimed
        raise SystemExit("DeepSpeed's MoE warm-up run failed (see above)")
    runs: dict[str, list[dict]] = {f: [] for f in MOE_FRAMEWORKS}
    for rep in range(args.repeats):
        for name in MOE_FRAMEWORKS if rep % 2 == 0 else MOE_FRAMEWORKS[::-1]:
            out = _run(name, args)
            if out is not None:
                runs[name].append(out)
                print(f"repeat {rep} {name}: {out['steps_per_s']:.2f} steps/s, "
                      f"peak RSS {out['peak_rss_mib']:.0f} MiB, "
                      f"CPU {out['cpu_ms_per_step']:.1f} ms/step")  # fmt: skip
    summary = {}
    for name, rs in runs.items():
        if rs:
            summary[name] = {
                "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
                "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                "cpu_ms_per_step": statistics.median(r["cpu_ms_per_step"] for r in rs),
            }
    print(
        f"\n{'framework':12}{'steps/s':>10}{'tokens/s':>12}{'peak RSS MiB':>14}{'CPU ms/step':>13}"
    )
    for name in MOE_FRAMEWORKS:
        if name in summary:
            s = summary[name]
            tok = s["steps_per_s"] * args.nproc * args.tokens
            print(f"{name:12}{s['steps_per_s']:10.2f}{tok:12.0f}{s['peak_rss_mib']:14.0f}"
                  f"{s['cpu_ms_per_step']:13.1f}")  # fmt: skip
    if "mt-moe" in summary and "ds-moe" in summary:
        m, d = summary["mt-moe"], summary["ds-moe"]
        summary["ratio_speed"] = m["steps_per_s"] / d["steps_per_s"]
        summary["ratio_peak_rss"] = m["peak_rss_mib"] / d["peak_rss_mib"]
        summary["ratio_cpu_per_step"] = m["cpu_ms_per_step"] / d["cpu_ms_per_step"]
        print(f"meshtrain / DeepSpeed MoE at ep {args.nproc}: speed {summary['ratio_speed']:.2f}x, "
              f"peak RSS {summary['ratio_peak_rss']:.2f}x, CPU per step "
              f"{summary['ratio_cpu_per_step']:.2f}x")  # fmt: skip
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or ROOT / "results" / f"moe-{now:%Y-%m-%d-%H%M}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": now.isoformat(), "versions": _versions(), "workload": MOE,
                               "args": vars(args), "runs": runs, "summary": summary}, indent=1))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
