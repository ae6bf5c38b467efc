"""Context-parallel attention against its peers on CPU/gloo, and activation memory per rank.

Issue 29's benchmark, in one run:

1. **Attention, cp 2.** The same causal attention (fp32, ``B=1``, ``--heads`` heads of
   ``--head-dim``, global length ``--seq``, seeded q/k/v) forward + backward on 2 ranks by

   ==================  ===========================================================================
   name                what
   ==================  ===========================================================================
   meshtrain           ``meshtrain.parallel.context.all_to_all.ulysses_attention`` on the
                       load-balanced layout (rank i holds chunks i and 2C-1-i), ``[B, H, L/C, hd]``
                       seen over ``[B, L/C, H, hd]`` memory (what a q/k/v projection gives,
                       ``proj(x).view(B, S, H, hd).transpose(1, 2)``: DeepSpeed's memory layout)
   deepspeed           ``deepspeed.sequence.layer.DistributedAttention`` (Ulysses) around the same
                       SDPA call, its own layout: contiguous ``[B, L/C, H, hd]`` chunks,
                       ``scatter_idx=2, gather_idx=1, batch_dim_idx=0``
   meshtrain-ring      ``meshtrain.parallel.context.ring``, same layout as meshtrain
   torch-cp            ``torch.distributed.tensor.experimental.context_parallel`` (ring) on a CPU
                       ``DeviceMesh``; where it cannot run its error is recorded and printed
   ==================  ===========================================================================

   Each framework runs in fresh ``torchrun`` processes (one thread per rank), ``--repeats``
   times, the order reversed on odd repeats. Time: the slowest rank's seconds per
   forward+backward over ``--iters`` iterations after one warm-up, and the CPU seconds per
   iteration summed over the ranks (``cpu``: steadier than wall time on a loaded machine,
   a speed ratio in the same sense: peer / meshtrain). Memory: ``saved`` is what
   autograd keeps for the backward after the forward (distinct storages,
   ``meshtrain.estimate.activation_probe``, deterministic), ``peak`` the larger rank's RSS
   high-water mark (``VmHWM``, reset after the warm-up through ``/proc/self/clear_refs``)
   minus its RSS then: the most bytes alive at once in a steady-state iteration,
   temporaries included. Workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed
   large blocks leave RSS (glibc's adaptive threshold otherwise keeps them resident
   differently for each framework). Every rank checks its output rows against a
   one-process ``causal_attention`` of the whole sequence (``max_rel_err``). Ratios are
   meshtrain / peer, medians of the same-round ratios (speed > 1 and memory < 1 favour
   meshtrain).

   ``--interleaved``: also the three (meshtrain, deepspeed, meshtrain-ring) in the same two
   processes, one after the other in each of ``--repeats`` rounds (order alternating), so
   that each round's ratios share the machine's load (paired; printed as peer time /
   meshtrain time, medians over the rounds, wall and CPU).

2. **Decoder activation memory at cp 1, 2, 4** (``--memory-lens``, default 8192 and
   16384): meshtrain's ``Decoder`` (2 layers, d 64, 4 heads, SwiGLU 172, vocab 256, fp32)
   forward + backward on each rank's ``L/C`` tokens (global positions as ``position_ids``),
   attention through ``ulysses_attention`` (``--memory-method ring``: ``ring_attention``)
   via the Decoder's ``Attention.context`` seam, in
   ``torchrun`` processes of ``C`` ranks, after one warm-up step. Recorded per rank:
   ``saved`` bytes, the formula (``meshtrain.estimate.activations.activation_bytes``), the
   peak RSS growth of the measured step (as above), the peak formula
   (``peak_activation_bytes``), and its seconds.

    python benchmarks/bench_context_parallel.py [--seq 4096] [--repeats 3] [--iters 5]
        [--memory-lens 8192,16384] [--memory-cps 1,2,4] [--memory-method all_to_all|ring]
        [--skip-memory] [--skip-attention] [--interleaved]

Results: ``benchmarks/results/context_parallel-<date>-<HHMM>.json`` (machine, versions,
load average, every run).
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

ROOT = Path(__file__).resolve().parent
FRAMEWORKS = ("meshtrain", "deepspeed", "meshtrain-ring", "torch-cp")
PAIRS = (("meshtrain", "deepspeed"), ("meshtrain-ring", "torch-cp"))
DECODER = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=172)
SEED = 1234


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """Reset this process's RSS high-water mark (``VmHWM``) and return the RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _shard(t, cp: int, rank: int, dim: int):
    import torch

    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)


# ------------------------------------------------------------------------ attention worker
def _attention_fn(name: str, group, cp: int, rank: int):
    """(fn(q, k, v) -> output, the function that cuts this rank's slice out of a whole
    ``[B, H, L, hd]`` tensor in the framework's own layout) for framework ``name``."""
    import torch.nn.functional as F

    def projected(t):  # [B, H, L/C, hd] over [B, L/C, H, hd] memory, as a projection gives
        return _shard(t, cp, rank, 2).transpose(1, 2).contiguous().transpose(1, 2)

    if name == "meshtrain":
        from meshtrain.parallel.context.all_to_all import ulysses_attention

        return lambda q, k, v: ulysses_attention(q, k, v, group), projected
    if name == "meshtrain-ring":
        from meshtrain.parallel.context import ring

        return lambda q, k, v: ring.ring_attention(q, k, v, group), projected
    if name == "deepspeed":
        from deepspeed.sequence.layer import DistributedAttention

        def local(q, k, v):  # [B, L, H/C, hd] -> SDPA on [B, H/C, L, hd]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            return o.transpose(1, 2)

        da = DistributedAttention(local, group.pg, scatter_idx=2, gather_idx=1)
        # its layout: contiguous chunk `rank` of the sequence, [B, L/C, H, hd]
        return (
            lambda q, k, v: da(q, k, v, 0),
            lambda t: t.chunk(cp, dim=2)[rank].transpose(1, 2).contiguous(),
        )
    if name == "torch-cp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (cp,))

        def probe(q, k, v):  # the whole sequence, sharded in place by the manager
            q, k, v = (t.detach().clone() for t in (q, k, v))
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                qq = q.detach().requires_grad_()
                F.scaled_dot_product_attention(qq, k, v, is_causal=True).sum().backward()

        return probe, None
    raise ValueError(name)


def attention_worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    if args.framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed("gloo", verbose=False)
    import torch.distributed as dist

    from meshtrain.distributed.env import init_distributed
    from meshtrain.distributed.topology import Topology
    from meshtrain.estimate.activation_probe import SavedBytes
    from meshtrain.models.attention import causal_attention

    if not dist.is_initialized():
        init_distributed()
    cp, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology(cp=cp)
    gen = torch.Generator().manual_seed(SEED)
    B, H, L, hd = 1, args.heads, args.seq, args.head_dim
    Q, K, V, G = (torch.randn(B, H, L, hd, generator=gen) for _ in range(4))
    out: dict = {"framework": args.framework, "world": cp}
    try:
        fn, mine = _attention_fn(args.framework, topo.cp_group, cp, rank)
        if mine is None:  # torch-cp: forward+backward inside its context manager
            fn(Q, K, V)  # on CPU this raises (recorded below)
            raise NotImplementedError("ran, but this script times it on CUDA only")
        q, k, v = (mine(t).requires_grad_(True) for t in (Q, K, V))
        g = mine(G)
        times, cpu, o, base = [], [], None, 0
        for i in range(args.iters + 1):
            q.grad = k.grad = v.grad = o = None
            if i == 1:  # after the warm-up: the steady state's peak, not the first call's
                base = _reset_peak()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if i == 1:
                with SavedBytes([q, k, v]) as probe:
                    o = fn(q, k, v)
                out["saved_bytes"] = probe.bytes
            else:
                o = fn(q, k, v)
            (o * g).sum().backward()
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)  # this process, gloo's threads too
        t = torch.tensor([sum(times) / len(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["seconds_per_iter"] = float(t)
        c = torch.tensor([sum(cpu) / len(cpu)], dtype=torch.float64)
        dist.all_reduce(c)  # summed over the ranks: steadier than wall time under load
        out["cpu_seconds_per_iter"] = float(c)
        growth = [None] * cp
        dist.all_gather_object(growth, _status("VmHWM") - base)
        out["peak_growth_bytes"] = max(growth)
        saved = [None] * cp
        dist.all_gather_object(saved, out["saved_bytes"])
        out["saved_bytes"] = max(saved)
        ref = causal_attention(Q, K, V)  # this rank's rows of the whole sequence's result
        err = float((o.detach() - mine(ref)).norm() / mine(ref).norm())
        errs = [None] * cp
        dist.all_gather_object(errs, err)
        out["max_rel_err"] = max(errs)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a result
        out["error"] = f"{type(exc).__name__}: {exc}"[:1500]
    if rank == 0:
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def interleaved_worker(args) -> None:
    """meshtrain, DeepSpeed and meshtrain's ring in the same two processes, one framework
    after the other in each round (order alternating), ``--iters`` timed iterations each
    after a warm-up: the rounds share the machine's load, so the per-round ratios are
    paired (``--interleaved``)."""
    import torch

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed("gloo", verbose=False)
    import torch.distributed as dist

    from meshtrain.distributed.topology import Topology

    cp, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology(cp=cp)
    gen = torch.Generator().manual_seed(SEED)
    B, H, L, hd = 1, args.heads, args.seq, args.head_dim
    Q, K, V, G = (torch.randn(B, H, L, hd, generator=gen) for _ in range(4))
    names = ("meshtrain", "deepspeed", "meshtrain-ring")
    fns = {n: _attention_fn(n, topo.cp_group, cp, rank) for n in names}
    rounds: list[dict] = []
    for rnd in range(args.repeats):
        row = {}
        for name in names if rnd % 2 == 0 else names[::-1]:
            fn, mine = fns[name]
            q, k, v = (mine(t).requires_grad_(True) for t in (Q, K, V))
            g = mine(G)
            for i in range(args.iters + 1):
                q.grad = k.grad = v.grad = None
                if i == 1:
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                (fn(q, k, v) * g).sum().backward()
            t = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64)
            c = torch.tensor([(time.process_time() - c0) / args.iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.all_reduce(c)
            row[name] = {"seconds_per_iter": float(t), "cpu_seconds_per_iter": float(c)}
        row["load"] = os.getloadavg()[0]
        rounds.append(row)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"rounds": rounds}))
    dist.barrier()
    dist.destroy_process_group()


def _interleaved(args) -> dict:
    common = ["--seq", str(args.seq), "--heads", str(args.heads), "--head-dim",
              str(args.head_dim), "--iters", str(args.iters), "--repeats", str(args.repeats)]  # fmt: skip
    r = _launch(2, ["--worker", "interleaved", *common])
    if "error" in r:
        print(f"interleaved: failed: {r['error'][:300]}")
        return r
    ratios = {}
    for peer in ("deepspeed", "meshtrain-ring"):
        per = [
            {
                k: x[peer][k] / x["meshtrain"][k]
                for k in ("seconds_per_iter", "cpu_seconds_per_iter")
            }
            for x in r["rounds"]
        ]
        ratios[f"{peer} / meshtrain"] = {
            "wall": statistics.median(p["seconds_per_iter"] for p in per),
            "cpu": statistics.median(p["cpu_seconds_per_iter"] for p in per),
            "per_round": per,
        }
        print(f"interleaved {peer} time / meshtrain time, median of {len(per)} rounds: wall "
              f"{ratios[f'{peer} / meshtrain']['wall']:.3f}x, cpu "
              f"{ratios[f'{peer} / meshtrain']['cpu']:.3f}x")  # fmt: skip
    r["ratios"] = ratios
    return r


# -------------------------------------------------------------------------- memory worker
class _Seam:
    """The Decoder's attention seam over the cp group with ``method`` (ring or all_to_all)."""

    def __init__(self, group, method: str) -> None:
        self.group, self.method = group, method

    def attend(self, q, k, v, *, document_ids=None, scale=None):
        if self.method == "ring":
            from meshtrain.parallel.context.ring import ring_attention as fn
        else:
            from meshtrain.parallel.context.all_to_all import ulysses_attention as fn
        return fn(q, k, v, self.group, document_ids=document_ids, scale=scale)


def memory_worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from meshtrain.distributed.env import init_distributed
    from meshtrain.distributed.topology import Topology
    from meshtrain.estimate.activation_probe import SavedBytes
    from meshtrain.estimate.activations import (
        DecoderDims,
        activation_bytes,
        peak_activation_bytes,
    )
    from meshtrain.models import Decoder, DecoderConfig

    init_distributed()
    cp, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology(cp=cp)
    L = args.seq
    model = Decoder(DecoderConfig(**DECODER, max_seq_len=L, seed=SEED))
    if cp > 1:
        for layer in model.layers:
            layer.attn.context = _Seam(topo.cp_group, args.memory_method)
    ids = torch.randint(
        0, DECODER["vocab_size"], (1, L), generator=torch.Generator().manual_seed(0)
    )
    pos = torch.arange(L)[None]
    ids, pos = _shard(ids, cp, rank, 1), _shard(pos, cp, rank, 1)
    model(ids, labels=ids, position_ids=pos).backward()  # warm-up
    model.zero_grad(set_to_none=True)
    base = _reset_peak()
    dist.barrier()
    t0 = time.perf_counter()
    with SavedBytes([*model.parameters(), *model.buffers()]) as probe:
        loss = model(ids, labels=ids, position_ids=pos)
    loss.backward()
    seconds = time.perf_counter() - t0
    kw = dict(seq_len=L, cp=cp, width=4, position_ids=True, method=args.memory_method)
    row = {
        "rank": rank,
        "saved_bytes": probe.bytes,
        "formula_bytes": activation_bytes(DecoderDims.of(model), **kw),
        "peak_formula_bytes": peak_activation_bytes(DecoderDims.of(model), **kw),
        "peak_growth_bytes": _status("VmHWM") - base,
        "seconds": seconds,
    }
    rows = [None] * cp
    dist.all_gather_object(rows, row)
    if rank == 0:
        out = {"seq": L, "cp": cp, "method": args.memory_method, "ranks": rows}
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------- driver
def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    # A fixed mmap threshold: every block of 64 KiB or more is its own mapping, returned to
    # the system when freed, so RSS follows the bytes alive (glibc's default threshold
    # grows after frees and keeps freed blocks resident, differently for each framework's
    # allocation order).
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT.parent / "src"), str(ROOT.parent), env.get("PYTHONPATH")])
    )
    return env


def _launch(nproc: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), __file__, *extra, "--result", str(result),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=1800)
        if result.exists():
            return json.loads(result.read_text())
        return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}


def _versions() -> dict:
    import torch

    def version(pkg: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(pkg)
        except Exception:  # noqa: BLE001
            return None

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "commit": commit,
        "load_average": os.getloadavg(),
    }


def _attention(args) -> dict:
    runs: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    common = ["--seq", str(args.seq), "--heads", str(args.heads), "--head-dim",
              str(args.head_dim), "--iters", str(args.iters)]  # fmt: skip
    for rep in range(args.repeats):
        for name in FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]:
            if rep and runs[name] and "error" in runs[name][0]:
                continue  # a peer that cannot run here fails the same way every time
            r = _launch(2, ["--worker", "attention", "--framework", name, *common])
            r["load_before"] = os.getloadavg()[0]
            runs[name].append(r)
            if "error" in r:
                print(f"repeat {rep} {name}: cannot run: {r['error'][:300]}")
            else:
                print(f"repeat {rep} {name}: {r['seconds_per_iter'] * 1e3:.0f} ms/iter "
                      f"(cpu {r['cpu_seconds_per_iter'] * 1e3:.0f} ms), saved "
                      f"{r['saved_bytes'] / 2**20:.1f} MiB, peak +{r['peak_growth_bytes'] / 2**20:.0f}"
                      f" MiB, rel err {r['max_rel_err']:.1e}")  # fmt: skip
    summary, ratios = {}, {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if ok:
            summary[name] = {
                k: statistics.median(r[k] for r in ok)
                for k in (
                    "seconds_per_iter",
                    "cpu_seconds_per_iter",
                    "saved_bytes",
                    "peak_growth_bytes",
                    "max_rel_err",
                )  # fmt: skip
            }
        elif rs:
            err = rs[0]["error"]
            missing = name == "meshtrain-ring" and err.startswith("ImportError")
            summary[name] = {"error": err, "not_on_branch": missing}
    for a, b in PAIRS:  # medians of the same-round ratios (the suite's convention)
        rounds = [
            (ra, rb)
            for ra, rb in zip(runs[a], runs[b], strict=False)
            if "error" not in ra and "error" not in rb
        ]
        if rounds:
            ratios[f"{a} vs {b}"] = {
                "speed": statistics.median(
                    rb["seconds_per_iter"] / ra["seconds_per_iter"] for ra, rb in rounds
                ),
                "saved_memory": statistics.median(
                    ra["saved_bytes"] / rb["saved_bytes"] for ra, rb in rounds
                ),
                "peak_memory": statistics.median(
                    ra["peak_growth_bytes"] / max(rb["peak_growth_bytes"], 1) for ra, rb in rounds
                ),
                "cpu": statistics.median(
                    rb["cpu_seconds_per_iter"] / ra["cpu_seconds_per_iter"] for ra, rb in rounds
                ),
                "speed_per_round": [
                    rb["seconds_per_iter"] / ra["seconds_per_iter"] for ra, rb in rounds
                ],
            }
    return {"runs": runs, "summary": summary, "ratios": ratios}


def _memory(args) -> list[dict]:
    table = []
    for length in args.memory_lens:
        for cp in args.memory_cps:
            r = _launch(cp, ["--worker", "memory", "--seq", str(length),
                             "--memory-method", args.memory_method])  # fmt: skip
            table.append(r)
            if "error" in r:
                print(f"L={length} cp={cp}: failed: {r['error'][:300]}")
                continue
            r0 = max(r["ranks"], key=lambda x: x["saved_bytes"])
            print(f"{args.memory_method} L={length} cp={cp}: saved {r0['saved_bytes'] / 2**20:.1f} MiB/rank, formula "
                  f"{r0['formula_bytes'] / 2**20:.1f} MiB, peak RSS +"
                  f"{max(x['peak_growth_bytes'] for x in r['ranks']) / 2**20:.1f} MiB, peak "
                  f"formula {r0['peak_formula_bytes'] / 2**20:.1f} MiB, "
                  f"{max(x['seconds'] for x in r['ranks']):.1f} s")  # fmt: skip
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("attention", "memory", "interleaved"))
    p.add_argument("--framework", choices=FRAMEWORKS)
    p.add_argument("--result")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8192, 16384])  # fmt: skip
    p.add_argument("--memory-cps", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 2, 4])  # fmt: skip
    p.add_argument("--memory-method", choices=("all_to_all", "ring"), default="all_to_all")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--interleaved", action="store_true",
                   help="also time the three frameworks in the same processes, round by round")  # fmt: skip
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker == "attention":
        return attention_worker(args)
    if args.worker == "memory":
        return memory_worker(args)
    if args.worker == "interleaved":
        return interleaved_worker(args)
    started = time.time()
    result = {"versions": _versions(), "args": vars(args)}
    if not args.skip_attention:
        result["attention"] = _attention(args)
    if args.interleaved:
        result["interleaved"] = _interleaved(args)
    if not args.skip_memory:
        result["memory"] = _memory(args)
    result["wall_seconds"] = time.time() - started
    attention = result.get("attention", {"ratios": {}, "summary": {}})
    for pair, r in attention["ratios"].items():
        print(f"pair {pair}: speed {r['speed']:.2f}x cpu {r['cpu']:.2f}x saved memory "
              f"{r['saved_memory']:.2f}x "
              f"peak memory {r['peak_memory']:.2f}x")  # fmt: skip
    for name, s in attention["summary"].items():
        if s.get("not_on_branch"):
            print(f"{name}: not on this branch (no meshtrain.parallel.context.ring): not run")
        elif "error" in s:
            print(f"{name}: cannot run on CPU/gloo: {s['error'][:400]}")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    path = Path(args.out) if args.out else ROOT / "results" / f"context_parallel-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
