"""meshtrain data parallelism vs torch DDP (and DeepSpeed ZeRO stage 0), side by side.

Issue 3's benchmark. Same model, data, optimizer and world size for every peer, in one
run; prints samples/s of each, the ratio meshtrain/peer, and checks that the per-step
losses agree. Target: meshtrain at least as fast as torch DistributedDataParallel.

Usage (from the repository root)::

    python -m benchmarks.bench_data_parallel [--nproc 2] [--steps 20] [--repeats 3]

The script is both the driver and the worker. The driver launches, for each repeat and
each peer in turn (peers interleaved so that background load hits all of them alike)::

    torchrun --standalone --nproc_per_node N benchmarks/bench_data_parallel.py \
        --worker PEER --result /tmp/....json ...

Peers:

* ``meshtrain``: ``meshtrain.initialize`` with ZeRO stage 0 (plain data parallelism),
  optimizer from the config (``AdamW``).
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``.
* ``meshtrain-noledger``: ``meshtrain`` with the collective ledger of the hang doctor off
  (``MESHTRAIN_LEDGER=0``); its ratio is the ledger's overhead (not run by default).
* ``deepspeed-z0``: ``deepspeed.initialize`` with ``zero_optimization.stage = 0`` and a
  client ``torch.optim.AdamW``, only when ``deepspeed`` is installed. It runs on CPU with
  gloo (``DS_ACCELERATOR=cpu``); its first run JIT-compiles a small op with ninja/g++, so
  the driver makes one untimed warm-up run first.

Workload (as in ``shared/PEERS.md``): the reference ``Decoder`` (4 layers, d=256, 4 heads,
SwiGLU 688, vocab 1024, 3.69M parameters), fp32, seed 1234, global batch 16 sequences x
32 tokens split evenly over the ranks, ``--steps`` AdamW steps (lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01 -- set explicitly for every peer), one thread per
rank. steps/s and samples/s exclude the first step (warm-up) and use the slowest rank's
clock. Each worker also records the per-step global mean loss, the median time of
forward / backward / optimizer step on rank 0 and the peak RSS (``VmHWM``) of every rank.

A run is judged by its result file: a peer that finished every step and wrote its result
but then crashed in gloo teardown (seen with some peers, see PEERS.md) counts as a
success and the non-zero exit is reported; a run with no result file is retried once.

Results go to ``benchmarks/results/data_parallel-<date>-np<N>[-bucket<B>].json`` (or
``--out``) with the machine, versions, date, arguments, every run and the summary.
``--reduce-bucket-size B`` sets meshtrain's ``zero_optimization.reduce_bucket_size``
(default: meshtrain's own default) to study gradient bucketing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peers import BETAS, EPS, LR, WEIGHT_DECAY, setup

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
RESULTS = HERE.parent / "results"
ALL_PEERS = ("meshtrain", "ddp", "deepspeed-z0", "meshtrain-noledger")

GLOBAL_BATCH = 16
SEQ_LEN = 32
SEED = 1234
MODEL = dict(
    vocab_size=1024, dim=256, n_layers=4, n_heads=4, ffn_dim=688, max_seq_len=64, seed=SEED
)


# ---------------------------------------------------------------------------------- worker


def _vm_hwm_mib() -> float:
    """Peak resident set size of this process (``VmHWM``), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from meshtrain.models import Decoder, DecoderConfig

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if GLOBAL_BATCH % world:
        raise SystemExit(f"global batch {GLOBAL_BATCH} does not split over {world} ranks")
    micro = GLOBAL_BATCH // world

    # Identical data on every rank for every peer; rank r takes rows [r*micro, (r+1)*micro).
    gen = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, MODEL["vocab_size"], (args.steps, GLOBAL_BATCH, SEQ_LEN), generator=gen)
    shards = data[:, rank * micro : (rank + 1) * micro].contiguous()

    torch.manual_seed(SEED)
    model = Decoder(DecoderConfig(**MODEL))
    n_params = sum(p.numel() for p in model.parameters())
    if args.worker == "meshtrain-noledger":  # the hang doctor's ledger off (its overhead)
        os.environ["MESHTRAIN_LEDGER"] = "0"
    aliases = {"meshtrain": "mt-z0", "meshtrain-noledger": "mt-z0", "deepspeed-z0": "ds-z0"}
    name = aliases.get(args.worker, args.worker)
    zero = {"reduce_bucket_size": args.reduce_bucket_size} if args.reduce_bucket_size else {}
    run = setup(name, model, micro=micro, world=world, zero=zero, threads=args.threads)
    forward, backward, step, shutdown = run.forward, run.backward, run.step, run.shutdown

    losses, phases, cpu, ends = [], [], [], []
    clock, cpu_clock = time.perf_counter, time.thread_time  # wall; this thread's CPU time
    dist.barrier()
    for i in range(args.steps):
        t0, c0 = clock(), cpu_clock()
        loss = forward(shards[i])
        t1, c1 = clock(), cpu_clock()
        backward(loss)
        t2, c2 = clock(), cpu_clock()
        step()
        t3, c3 = clock(), cpu_clock()
        losses.append(loss.detach().float().clone())
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        cpu.append((c1 - c0, c2 - c1, c3 - c2))
        ends.append(t3)

    # Everything below is outside the timed region.
    elapsed = torch.tensor([ends[-1] - ends[0]], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's clock
    loss_t = torch.stack(losses).double()
    dist.all_reduce(loss_t)  # sum of per-rank means of equal shards -> global mean
    loss_t /= world
    rss = [None] * world
    dist.all_gather_object(rss, _vm_hwm_mib())
    timed = args.steps - 1
    if rank == 0:

        def medians_ms(rows):
            names = ("forward", "backward", "step")
            out = {n: 1e3 * statistics.median(r[k] for r in rows[1:]) for k, n in enumerate(names)}
            out["total"] = 1e3 * statistics.median(sum(r) for r in rows[1:])
            return out

        result = {
            "peer": args.worker,
            "world_size": world,
            "micro_batch_per_rank": micro,
            "global_batch": GLOBAL_BATCH,
            "seq_len": SEQ_LEN,
            "steps": args.steps,
            "timed_steps": timed,
            "n_params": n_params,
            "torch_threads": torch.get_num_threads(),
            "timed_seconds": float(elapsed),
            "steps_per_s": timed / float(elapsed),
            "samples_per_s": timed * GLOBAL_BATCH / float(elapsed),
            "rank0_step_ms": [1e3 * sum(p) for p in phases],
            # medians over the timed steps on rank 0: wall clock, and the main thread's CPU
            # time (less sensitive to other jobs on the machine; excludes gloo's threads)
            "rank0_median_ms": medians_ms(phases),
            "rank0_median_cpu_ms": medians_ms(cpu),
            "losses": [float(x) for x in loss_t],
            "peak_rss_mib_per_rank": rss,
        }
        tmp = args.result + ".part"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result)  # the driver judges the run by this file
    shutdown()


# ---------------------------------------------------------------------------------- driver


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*argv: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _machine() -> dict:
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    model_name = platform.processor() or None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model_name,
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hostname": platform.node(),
    }


def _worker_env() -> dict:
    env = dict(os.environ)
    src = str(REPO / "src") + os.pathsep + str(REPO)  # meshtrain, and the benchmarks package
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_worker(
    script: Path,
    name: str,
    worker_args: list[str],
    *,
    nproc: int,
    tmpdir: str,
    tag: str,
    timeout: float,
    env: dict | None = None,
) -> dict:
    """One torchrun of ``script --worker name``; returns {"ok", "result"|"error", "rc",
    "wall_s", ...}. A run is judged by its result file: one that wrote it and then crashed
    in gloo teardown (see PEERS.md) is a success with a note."""
    result_path = os.path.join(tmpdir, f"{name}-{tag}.json")
    log_path = os.path.join(tmpdir, f"{name}-{tag}.log")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc), "-m", f"benchmarks.{Path(script).stem}",
        "--worker", name, "--result", result_path, *worker_args,
    ]  # fmt: skip
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(
                cmd,
                cwd=REPO,
                env=env or _worker_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    out = {"rc": rc, "wall_s": round(wall, 1), "load1_before": round(load_before, 2)}
    if os.path.exists(result_path):
        with open(result_path) as f:
            out.update(ok=True, result=json.load(f))
        if rc != 0:
            out["note"] = f"finished all steps, then exited rc {rc} (teardown crash)"
    else:
        with open(log_path, errors="replace") as f:
            out.update(ok=False, error=f.read()[-3000:])
    return out


def run_with_retry(launch, name: str, tag: str) -> dict:
    """``launch(tag)``, and once more if it left no result file."""
    out = launch(tag)
    if not out["ok"]:
        print(
            f"    {name}: no result (rc {out['rc']}); retrying once. Log tail:\n"
            + _indent(out["error"][-1200:]),
            flush=True,
        )
        retry = launch(tag + "-retry")
        retry["retried_after"] = {"rc": out["rc"], "error_tail": out["error"][-1200:]}
        out = retry
    return out


def _run_with_retry(peer: str, args, steps: int, tmpdir: str, tag: str) -> dict:
    extra = ["--steps", str(steps), "--threads", str(args.threads)]
    if args.reduce_bucket_size:
        extra += ["--reduce-bucket-size", str(args.reduce_bucket_size)]

    def launch(t: str) -> dict:
        return run_worker(
            HERE, peer, extra, nproc=args.nproc, tmpdir=tmpdir, tag=t, timeout=args.timeout
        )

    return run_with_retry(launch, peer, tag)


def _indent(text: str) -> str:
    return "\n".join("      | " + line for line in text.splitlines())


def _deepspeed_status(args: argparse.Namespace, tmpdir: str) -> tuple[bool, str]:
    """Is deepspeed importable and runnable here? Runs one untimed warm-up (JIT op build)."""
    if importlib.util.find_spec("deepspeed") is None:
        return False, "deepspeed is not installed"
    print("warming up DeepSpeed (untimed; its first run JIT-compiles a comm op) ...", flush=True)
    out = _run_with_retry("deepspeed-z0", args, 3, tmpdir, "warmup")
    if not out["ok"]:
        return False, "deepspeed warm-up run failed:\n" + out["error"][-1500:]
    return True, f"warm-up run took {out['wall_s']} s"


def _driver(args: argparse.Namespace) -> int:
    date = _dt.datetime.now().astimezone()
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in ALL_PEERS:
            raise SystemExit(f"--peers: unknown peer {p!r}; choose from {', '.join(ALL_PEERS)}")
    if "meshtrain" not in peers:
        raise SystemExit("--peers must include meshtrain (ratios are meshtrain/peer)")
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (the first step is not timed)")
    machine = _machine()
    print(
        f"meshtrain data parallel vs peers: {args.nproc} ranks x {args.threads} thread, "
        f"global batch {GLOBAL_BATCH} x seq {SEQ_LEN}, {args.steps} AdamW steps, fp32, "
        f"{args.repeats} repeats; {machine['cpu_count']} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    if args.nproc > (machine["cpu_count"] or 1):
        print(
            f"note: {args.nproc} ranks on {machine['cpu_count']} CPUs is oversubscribed: "
            "the numbers measure contention, not scaling",
            flush=True,
        )

    skipped: dict[str, str] = {}
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_dp_") as tmpdir:
        if "deepspeed-z0" in peers:
            ok, why = _deepspeed_status(args, tmpdir)
            print(f"  deepspeed-z0: {why if ok else 'skipped: ' + why}", flush=True)
            if not ok:
                skipped["deepspeed-z0"] = why
                peers.remove("deepspeed-z0")
                runs.pop("deepspeed-z0")
        for r in range(args.repeats):
            for peer in peers:
                out = _run_with_retry(peer, args, args.steps, tmpdir, f"r{r}")
                runs[peer].append(out)
                if out["ok"]:
                    res = out["result"]
                    msg = (
                        f"{res['samples_per_s']:7.1f} samples/s {res['steps_per_s']:6.2f} "
                        f"steps/s (fwd/bwd/step {res['rank0_median_ms']['forward']:.0f}/"
                        f"{res['rank0_median_ms']['backward']:.0f}/"
                        f"{res['rank0_median_ms']['step']:.0f} ms)"
                    )
                else:
                    msg = "FAILED twice"
                extra = f" [{out['note']}]" if out.get("note") else ""
                extra += " [retried]" if out.get("retried_after") else ""
                print(
                    f"  repeat {r + 1}/{args.repeats} {peer:13s} {msg}  "
                    f"load {out['load1_before']:.2f}, {out['wall_s']} s{extra}",
                    flush=True,
                )
    total_s = time.perf_counter() - t_start

    # ---- summary
    summary: dict[str, dict] = {}
    for peer, outs in runs.items():
        good = [o["result"] for o in outs if o["ok"]]
        if not good:
            summary[peer] = {"ok_runs": 0}
            continue
        summary[peer] = {
            "ok_runs": len(good),
            "samples_per_s_median": statistics.median(g["samples_per_s"] for g in good),
            "steps_per_s_median": statistics.median(g["steps_per_s"] for g in good),
            "samples_per_s_all": [g["samples_per_s"] for g in good],
            "peak_rss_mib_max_rank_median": statistics.median(
                max(g["peak_rss_mib_per_rank"]) for g in good
            ),
            "rank0_median_ms": {
                k: statistics.median(g["rank0_median_ms"][k] for g in good)
                for k in ("forward", "backward", "step", "total")
            },
            "rank0_median_cpu_ms": {
                k: statistics.median(g["rank0_median_cpu_ms"][k] for g in good)
                for k in ("forward", "backward", "step", "total")
            },
            "teardown_crashes": sum(1 for o in outs if o.get("note")),
            "retries": sum(1 for o in outs if o.get("retried_after")),
        }
    mt = summary.get("meshtrain", {})
    mt_losses = next((o["result"]["losses"] for o in runs["meshtrain"] if o["ok"]), None)
    for peer, s in summary.items():
        if not s.get("ok_runs") or not mt.get("ok_runs"):
            continue
        s["ratio_meshtrain_over_peer"] = mt["samples_per_s_median"] / s["samples_per_s_median"]
        # paired: the same repeat round, so slow background phases hit both
        pairs = [
            a["result"]["samples_per_s"] / b["result"]["samples_per_s"]
            for a, b in zip(runs["meshtrain"], runs[peer], strict=False)
            if a["ok"] and b["ok"]
        ]
        s["paired_ratio_median"] = statistics.median(pairs) if pairs else None
        peer_losses = [o["result"]["losses"] for o in runs[peer] if o["ok"]]
        s["max_abs_loss_diff_vs_meshtrain"] = max(
            max(abs(a - b) for a, b in zip(mt_losses, pl, strict=True)) for pl in peer_losses
        )

    print()
    print(
        f"{args.nproc} ranks, medians of {args.repeats} repeats; ratio = meshtrain / peer "
        "samples/s (>1: meshtrain faster); paired = median of same-round ratios"
    )
    header = (
        f"{'peer':14s} {'samples/s':>10s} {'steps/s':>8s} {'RSS MiB':>8s} "
        f"{'ratio':>6s} {'paired':>7s} {'wall fwd/bwd/step':>17s} {'cpu fwd/bwd/step':>16s} "
        f"{'max|dloss|':>11s}"
    )
    print(header)
    print("-" * len(header))
    for peer, s in summary.items():
        if not s.get("ok_runs"):
            print(f"{peer:14s} FAILED")
            continue
        ms = s["rank0_median_ms"]
        phases = f"{ms['forward']:.0f}/{ms['backward']:.0f}/{ms['step']:.0f}"
        cms = s["rank0_median_cpu_ms"]
        cpu = f"{cms['forward']:.0f}/{cms['backward']:.0f}/{cms['step']:.0f}"
        paired = s.get("paired_ratio_median")
        print(
            f"{peer:14s} {s['samples_per_s_median']:10.1f} {s['steps_per_s_median']:8.2f} "
            f"{s['peak_rss_mib_max_rank_median']:8.0f} "
            f"{s.get('ratio_meshtrain_over_peer', float('nan')):6.2f} "
            f"{paired if paired is not None else float('nan'):7.2f} {phases:>17s} {cpu:>16s} "
            f"{s.get('max_abs_loss_diff_vs_meshtrain', float('nan')):11.2e}"
        )
    for peer, why in skipped.items():
        print(f"{peer:14s} skipped: {why.splitlines()[0]}")
    print(
        "(fwd/bwd/step: rank 0 medians in ms, wall clock and main-thread CPU time; meshtrain "
        "waits for the gradient all-reduce in step(), DDP and DeepSpeed at the end of backward)"
    )
    load_end = os.getloadavg()
    print(
        f"load average at end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f} "
        f"on {machine['cpu_count']} CPUs; total {total_s:.0f} s. The machine is shared: "
        "expect +-10-20% between runs."
    )

    ok = all(s.get("ok_runs") for s in summary.values())
    loss_ok = all(
        s.get("max_abs_loss_diff_vs_meshtrain", 0.0) <= args.loss_tol for s in summary.values()
    )
    if not loss_ok:
        print(f"WARNING: some peer's losses differ from meshtrain's by more than {args.loss_tol:g}")
    target = summary.get("ddp", {}).get("ratio_meshtrain_over_peer")
    if target is not None:
        verdict = "met" if target >= 1.0 else "NOT met"
        if target < 1.0 and target >= 0.9:
            verdict += " (but within this shared machine's +-10% noise; see the paired ratio)"
        print(f"target (meshtrain at least as fast as torch DDP): {verdict} ({target:.3f}x)")

    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        suffix = f"-bucket{args.reduce_bucket_size}" if args.reduce_bucket_size else ""
        path = (
            Path(args.out)
            if args.out
            else (RESULTS / f"data_parallel-{date:%Y-%m-%d}-np{args.nproc}{suffix}.json")
        )
        record = {
            "benchmark": "data_parallel",
            "date": date.isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
            "workload": {
                "model": "meshtrain.models.Decoder",
                "model_config": MODEL,
                "global_batch": GLOBAL_BATCH,
                "seq_len": SEQ_LEN,
                "dtype": "float32",
                "optimizer": {
                    "type": "AdamW",
                    "lr": LR,
                    "betas": list(BETAS),
                    "eps": EPS,
                    "weight_decay": WEIGHT_DECAY,
                },
                "timing": "first step excluded; slowest rank's clock",
            },
            "machine": machine,
            "load_average_end": list(load_end),
            "versions": {
                "torch": _version("torch"),
                "deepspeed": _version("deepspeed"),
                "meshtrain": _version("meshtrain"),
                "git_commit": _git("rev-parse", "HEAD"),
                "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            },
            "summary": summary,
            "skipped": skipped,
            "runs": runs,
            "total_seconds": round(total_s, 1),
        }
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"results written to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0 if ok and loss_ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (data-parallel size)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per peer (median taken)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument(
        "--peers",
        default=",".join(ALL_PEERS[:3]),
        help="comma-separated subset of: " + ", ".join(ALL_PEERS),
    )
    ap.add_argument("--timeout", type=int, default=300, help="seconds per torchrun")
    ap.add_argument(
        "--loss-tol", type=float, default=1e-5, help="max abs per-step loss difference vs meshtrain"
    )
    ap.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=None,
        help="meshtrain zero_optimization.reduce_bucket_size (default: its default)",
    )
    ap.add_argument("--out", default=None, help="result JSON path (default: benchmarks/results/)")
    ap.add_argument("--no-save", action="store_true", help="do not write the result JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
