"""Asynchronous checkpoint save: meshtrain's ``checkpoint.async_save`` vs torch DCP's ``async_save``.

Issue 31's benchmark. One run, the same 2 gloo ranks, the same state (each rank's ZeRO-2
shard of the fp32 masters and both AdamW moments of the reference decoder, plus the RNG
and scheduler state a checkpoint holds), measured in this order, each ``--repeats`` times
(medians printed):

* **plain copy** -- ``clone()`` of every tensor this rank's save writes: the least a
  save that lets training go on can block (the limit);
* **sync save** -- ``engine.save_checkpoint`` with ``async_save`` off (write, fsync,
  sha256, manifest, commit);
* **meshtrain async** -- ``engine.save_checkpoint`` with ``async_save`` on: *blocked* is
  the call's time, *total* the time until ``wait_for_checkpoint`` returns (committed);
* **DCP async** -- ``torch.distributed.checkpoint.async_save`` of the same tensors (each
  rank's under its own keys, so nothing is deduplicated away): *blocked* is the call,
  *total* until its future's ``result()``;
* **throughput** -- optimizer steps per second over ``--steps`` steps with no save, with
  an async save every 5 steps, and with a sync save every 5 steps (slowest rank's clock).

Targets (the issue's): meshtrain blocked <= 1.0x DCP's and total <= 1.0x DCP's; throughput
with an async save every 5 steps >= 0.9 of none.

    python -m benchmarks.bench_async_save [--dim 384] [--layers 6] [--steps 30] [--repeats 3]

The script is the driver and the worker (``--worker``, under torchrun). Results go to
``benchmarks/results/async-save-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import meshtrain
    from meshtrain.engine.checkpoint_save import shard_contents
    from meshtrain.models import Decoder, DecoderConfig

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=8192, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                        ffn_dim=4 * args.dim, max_seq_len=64, tie_embeddings=True)  # fmt: skip
    model = Decoder(cfg)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**6,
        "checkpoint": {"async_save": False},
    }
    engine, *_ = meshtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)  # fmt: skip
    rank = dist.get_rank()
    root = Path(args.dir)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.vocab_size, (4, 64), generator=g)

    def step():
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()

    for _ in range(2):
        step()
    _, contents = shard_contents(engine, "probe", None)
    nbytes = sum(t.numel() * t.element_size() for t in contents["tensors"].values())
    out: dict = {"rank_bytes": nbytes, "copy": [], "sync": [], "mt_blocked": [],
                 "mt_total": [], "dcp_blocked": [], "dcp_total": []}  # fmt: skip
    ck = engine.config.checkpoint

    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        _, c = shard_contents(engine, "copy", None)
        copies = {k: v.clone() for k, v in c["tensors"].items()}
        out["copy"].append(_slowest(time.perf_counter() - t0))
        del copies

        object.__setattr__(ck, "async_save", False)
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(root / "sync", tag=f"s{i}")
        out["sync"].append(_slowest(time.perf_counter() - t0))

        object.__setattr__(ck, "async_save", True)
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(root / "mt", tag=f"a{i}")
        blocked = time.perf_counter() - t0
        engine.wait_for_checkpoint()
        total = time.perf_counter() - t0
        out["mt_blocked"].append(_slowest(blocked))
        out["mt_total"].append(_slowest(total))

        _, c = shard_contents(engine, "dcp", None)
        state = {f"rank{rank}/{k}": v for k, v in c["tensors"].items()}
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(root / "dcp" / f"d{i}"))
        blocked = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        out["dcp_blocked"].append(_slowest(blocked))
        out["dcp_total"].append(_slowest(total))
        dist.barrier()
        if rank == 0:  # keep the disk use flat
            for sub in ("sync", "mt", "dcp"):
                shutil.rmtree(root / sub, ignore_errors=True)
        dist.barrier()

    def run(save: str | None) -> float:
        object.__setattr__(ck, "async_save", save == "async")
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(args.steps):
            step()
            if save and (s + 1) % 5 == 0:
                engine.save_checkpoint(root / f"run-{save}", tag=f"step{s + 1}")
        engine.wait_for_checkpoint()  # the last write is part of the run
        return args.steps / _slowest(time.perf_counter() - t0)

    for name in ("none", "async", "sync", "none"):  # none twice: before and after
        out.setdefault(f"steps_per_s_{name}", []).append(run(None if name == "none" else name))
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()


def _driver(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="meshtrain-async-bench-"))
    result = tmp / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.nproc), str(Path(__file__)), "--worker", "--result", str(result),
           "--dir", str(tmp / "ckpt"), "--dim", str(args.dim), "--layers", str(args.layers),
           "--steps", str(args.steps), "--repeats", str(args.repeats)]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, env=env, timeout=args.timeout)
        r = json.loads(result.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list)}
    none = med["steps_per_s_none"]
    print(f"state per rank: {r['rank_bytes'] / 2**20:.1f} MiB ({args.nproc} ranks, ZeRO-2 "
          f"masters + AdamW moments); medians of {args.repeats}")  # fmt: skip
    print(f"  plain copy        {med['copy'] * 1e3:9.1f} ms  (the limit)")
    print(f"  sync save         {med['sync'] * 1e3:9.1f} ms")
    print(f"  meshtrain async   blocked {med['mt_blocked'] * 1e3:9.1f} ms, "
          f"total {med['mt_total'] * 1e3:9.1f} ms")  # fmt: skip
    print(f"  DCP async_save    blocked {med['dcp_blocked'] * 1e3:9.1f} ms, "
          f"total {med['dcp_total'] * 1e3:9.1f} ms")  # fmt: skip
    ratios = {
        "blocked_vs_copy": med["mt_blocked"] / med["copy"],
        "blocked_vs_sync": med["mt_blocked"] / med["sync"],
        "blocked_vs_dcp": med["mt_blocked"] / med["dcp_blocked"],
        "total_vs_dcp": med["mt_total"] / med["dcp_total"],
        "throughput_async_every5_vs_none": med["steps_per_s_async"] / none,
        "throughput_sync_every5_vs_none": med["steps_per_s_sync"] / none,
    }
    print(f"  steps/s: none {none:.2f}, async save every 5 {med['steps_per_s_async']:.2f}, "
          f"sync save every 5 {med['steps_per_s_sync']:.2f}")  # fmt: skip
    for k, v in ratios.items():
        print(f"  {k:34s} {v:.3f}x")
    out = HERE / "results" / f"async-save-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out.parent.mkdir(exist_ok=True)
    import torch

    out.write_text(json.dumps({
        "args": vars(args), "raw": r, "medians": med, "ratios": ratios,
        "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }, indent=2))  # fmt: skip
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1200)
    args = ap.parse_args(argv)
    if args.worker:
        import meshtrain

        meshtrain.init_distributed()
        _worker(args)
        return 0
    return _driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
