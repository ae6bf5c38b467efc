"""meshtrain ZeRO stages 1-3 vs torch ZeroRedundancyOptimizer, torch FSDP2 and DeepSpeed ZeRO.

Issue 4's benchmark. Same model, data, optimizer and world size for every framework, in
one run; prints samples/s of each, the ratio meshtrain/peer for each pair, the peak RSS
of every rank side by side, and checks that the per-step losses agree.
Target: meshtrain at least as fast as each peer and using no more memory.

Usage (from the repository root)::

    python -m benchmarks.bench_zero [--nproc 2] [--steps 12] [--warmup 2] [--repeats 2]
    python -m benchmarks.bench_zero --combine results/zero-A.json results/zero-B.json
    python -m benchmarks.bench_zero --frameworks mt-z3,fsdp2 --repeats 1 --profile-memory
    python -m benchmarks.bench_zero --repeats 1 --malloc-mmap-threshold 1048576

``--combine`` runs nothing and reports the medians over the repeats of several result
files (the machine is noisy: run the benchmark more than once). ``--profile-memory``
records the tensor allocations of the untimed probe step with the torch profiler: the
peak of each phase above the step's start and the allocations alive at that moment,
grouped by the code that made them (slow; for diagnosis). ``--malloc-mmap-threshold``
pins glibc's mmap threshold in the workers so that peak RSS follows live tensor bytes
rather than heap retention.

The script is both the driver and the worker. For each repeat the driver launches every
framework in turn, in fresh processes (the order is reversed on odd repeats so that slow
drifts of the background load hit all of them alike)::

    python -m torch.distributed.run --standalone --nproc_per_node N \
        benchmarks/bench_zero.py --worker NAME --result /tmp/....json ...

Frameworks, and the pairs compared (meshtrain / peer):

==============  ==========================================================  ============
name            what                                                        compared to
==============  ==========================================================  ============
mt-z1           ``meshtrain.initialize``, ``zero_optimization.stage = 1``   torch-zero1,
                                                                            ds-z1
mt-z2           the same, stage 2                                           fsdp2-nrf,
                                                                            ds-z2
mt-z3           the same, stage 3                                           fsdp2, ds-z3
torch-zero1     ``ZeroRedundancyOptimizer`` over ``torch.optim.AdamW``,
                inside ``DistributedDataParallel``
fsdp2           ``fully_shard`` on every block and on the root, on
                ``init_device_mesh("cpu", (N,))``, reshard_after_forward=True
fsdp2-nrf       the same with reshard_after_forward=False (ZeRO-2-like)
ds-z1/2/3       ``deepspeed.initialize`` with a client ``torch.optim.AdamW``,
                fp32, ZeRO stage 1/2/3, ``gradient_clipping: 0.0`` (DeepSpeed
                0.19.8 clips at 1.0 by default), ``DS_ACCELERATOR=cpu``
==============  ==========================================================  ============

meshtrain and DeepSpeed get the same ZeRO bucket settings (``--reduce-bucket-size``,
``--prefetch-bucket-size``, ``--persistence-threshold``; the same value also goes to
DeepSpeed's ``allgather_bucket_size``). DeepSpeed's first run JIT-compiles a small
communication op with ninja/g++, so the driver makes one untimed warm-up run of it (on a
tiny model) before anything is timed.

Workload: the reference ``Decoder`` (8 layers, d=768, 12 heads, SwiGLU 2048, vocab 8192,
69.2M parameters: its 1.1 GB of fp32 model states, not the ~220 MiB that importing torch
and meshtrain costs here, dominate RSS),
fp32, seed 1234, global batch 8 sequences x 64 tokens split evenly over the ranks (rank
``r`` takes rows ``[r m, (r + 1) m)``), AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight decay 0.01, set explicitly for every framework), no clipping, one thread per
rank. samples/s excludes the ``--warmup`` first steps and uses the slowest rank's clock.

Each worker records: the per-step global mean loss; rank 0's median forward / backward /
optimizer-step time (wall and main-thread CPU time); every rank's peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss`` when the timed steps end) and its peak / current RSS
at milestones (after imports, after building the model, after wrapping it, after the
warm-up steps, at the end) and after each phase of every step; then, in one more untimed
probe step, the model-state bytes the rank holds (parameters and ``.grad`` after backward,
optimizer state and separate fp32 masters after the step, counted from its tensors) and
the tensor bytes reachable from Python; for meshtrain also ``engine.memory_report()``
(measured vs the ZeRO formula) and ``engine.last_step_comm_bytes()`` of every step.

A run is judged by its result file: a framework that finished and wrote its result but
then crashed in gloo teardown (seen with some peers, see PEERS.md) counts as a success
and the non-zero exit is reported; a run with no result file is retried once.

Results go to ``benchmarks/results/zero-<date>-<HHMM>-np<N>[-<tag>].json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_data_parallel import (  # house helpers, shared with issue 3's bench
    REPO,
    RESULTS,
    _git,
    _machine,
    _version,
    _worker_env,
    run_with_retry,
    run_worker,
)
from benchmarks.peers import BETAS, EPS, LR, WEIGHT_DECAY, setup

GLOBAL_BATCH = 8
SEQ_LEN = 64
SEED = 1234
HERE = Path(__file__).resolve()
MODEL = dict(
    vocab_size=8192, dim=768, n_layers=8, n_heads=12, ffn_dim=2048, max_seq_len=64, seed=SEED
)
TINY_MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=2, ffn_dim=128, max_seq_len=64)

MESHTRAIN = ("mt-z1", "mt-z2", "mt-z3")
ALL = ("mt-z1", "torch-zero1", "ds-z1", "mt-z2", "fsdp2-nrf", "ds-z2", "mt-z3", "fsdp2", "ds-z3")
PAIRS = (
    ("mt-z1", "torch-zero1"),
    ("mt-z1", "ds-z1"),
    ("mt-z2", "fsdp2-nrf"),
    ("mt-z2", "ds-z2"),
    ("mt-z3", "fsdp2"),
    ("mt-z3", "ds-z3"),
)
MiB = 2**20
FIRST_STEPS = 3  # losses of the first steps must agree within --loss-tol (relative)


# ---------------------------------------------------------------------------------- worker


def _rss_mib() -> tuple[float, float]:
    """(peak RSS from getrusage, current VmRSS) of this process, MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    cur = float("nan")
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
                break
    return round(peak, 1), round(cur, 1)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _live_tensor_mib() -> float:
    """MiB of distinct tensor storages reachable from Python objects (gc), this process.

    Framework-agnostic count of what is alive: parameters, gradients, optimizer states,
    flat buffers, data. Tensors held only from C++ (autograd's saved tensors, gloo work
    objects) are not seen."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            t = getattr(obj, "_local_tensor", obj)
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # noqa: BLE001  (meta/fake tensors, odd subclasses)
            continue
    return round(sum(seen.values()) / MiB, 1)


def _mib(d: dict[str, int]) -> dict[str, float]:
    return {k: round(v / MiB, 1) for k, v in d.items()}


def _memory_profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)


_SITE_MARKERS = ("meshtrain/", "deepspeed/", "torch/distributed/", "torch/optim/")


def _analyse_allocations(prof, top: int = 12) -> dict:
    """Tensor allocations of the profiled step, from the profiler's event tree.

    Returns the peak of (bytes allocated - bytes freed) since the step began, the phase it
    happened in, and the allocations still alive at that moment grouped by where they were
    made: the innermost autograd function and aten op, and the innermost frame in
    meshtrain / deepspeed / torch.distributed / torch.optim (else the model code)."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    events, phases = [], []
    for n in walk(prof.profiler.kineto_results.experimental_event_tree()):
        if n.typed[0] == _EventType.Allocation:
            events.append(n)
        elif n.name.startswith("phase:"):  # record_function ranges (not tree ancestors)
            phases.append((n.start_time_ns, n.end_time_ns, n.name[6:]))
    events.sort(key=lambda n: n.start_time_ns)

    def phase_at(t: int) -> str:
        return next((name for a, b, name in phases if a <= t <= b), "between")

    def site(node) -> tuple[str, str]:
        op = autograd = frame = model = None
        p = node.parent
        while p is not None:
            name = p.name
            if op is None and name.startswith("aten::"):
                op = name
            elif autograd is None and name.startswith("autograd::engine::evaluate_function"):
                autograd = name.split(": ", 1)[-1]
            elif frame is None and any(m in name for m in _SITE_MARKERS):
                frame = name.split("site-packages/")[-1].split("src/")[-1]
            elif model is None and "models/decoder.py" in name:
                model = name.split("src/")[-1]
            p = p.parent
        where = frame or model or "?"
        what = " ".join(x for x in (autograd, op) if x) or "?"
        return phase_at(node.start_time_ns), f"{what} @ {where}"

    live: dict[int, tuple[int, tuple[str, str]]] = {}
    total = 0
    # per phase: (peak bytes above the step start, allocations alive at that moment)
    peaks: dict[str, tuple[int, dict]] = {}
    for n in events:
        f = n.typed[1]
        size = int(f.alloc_size)
        total += size
        if size > 0:
            live[f.ptr] = (size, site(n))
        else:
            live.pop(f.ptr, None)
        ph = phase_at(n.start_time_ns)
        if total > peaks.get(ph, (-1, None))[0]:
            peaks[ph] = (total, dict(live))

    def by_site(snapshot: dict) -> list:
        acc: dict[str, int] = {}
        for size, (phase, where) in snapshot.values():
            key = f"[{phase}] {where}"
            acc[key] = acc.get(key, 0) + size
        rows = sorted(acc.items(), key=lambda kv: -kv[1])
        out = [[k, round(v / MiB, 1)] for k, v in rows[:top] if v >= MiB]
        rest = sum(v for _, v in rows) - sum(v for _, v in rows[: len(out)])
        return [*out, ["(other)", round(rest / MiB, 1)]]

    worst = max(peaks, key=lambda k: peaks[k][0]) if peaks else "?"
    return {
        "peak_above_step_start_mib": round(peaks[worst][0] / MiB, 1) if peaks else 0.0,
        "peak_phase": worst,
        "net_at_step_end_mib": round(total / MiB, 1),
        "by_phase": {
            ph: {"peak_above_step_start_mib": round(v / MiB, 1), "live_by_site_mib": by_site(snap)}
            for ph, (v, snap) in peaks.items()
            if ph != "between"
        },
    }


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from meshtrain.models import Decoder, DecoderConfig

    milestones: dict[str, tuple[float, float]] = {"imports": _rss_mib()}
    name = args.worker
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if GLOBAL_BATCH % world:
        raise SystemExit(f"global batch {GLOBAL_BATCH} does not split over {world} ranks")
    micro = GLOBAL_BATCH // world
    model_cfg = dict(TINY_MODEL, seed=SEED) if args.tiny else MODEL

    # Identical data on every rank for every framework; rank r takes rows [r*m, (r+1)*m).
    gen = torch.Generator().manual_seed(SEED)
    data = torch.randint(
        0, model_cfg["vocab_size"], (args.steps, GLOBAL_BATCH, SEQ_LEN), generator=gen
    )
    shards = data[:, rank * micro : (rank + 1) * micro].contiguous()

    torch.manual_seed(SEED)
    model = Decoder(DecoderConfig(**model_cfg))
    n_params = sum(p.numel() for p in model.parameters())
    milestones["model built"] = _rss_mib()
    zero_common = {
        "reduce_bucket_size": args.reduce_bucket_size,
        "allgather_bucket_size": args.reduce_bucket_size,
        "stage3_prefetch_bucket_size": args.prefetch_bucket_size,
        "stage3_param_persistence_threshold": args.persistence_threshold,
    }
    run = setup(name, model, micro=micro, world=world, zero=zero_common, threads=args.threads)
    del model
    engine = run.engine
    comm_bytes: list[dict] = []
    forward, backward, state, shutdown = run.forward, run.backward, run.state, run.shutdown

    def step():
        run.step()
        if engine is not None:
            comm_bytes.append(engine.last_step_comm_bytes())

    milestones["wrapped"] = _rss_mib()
    losses, phases, cpu, ends, peaks = [], [], [], [], []
    clock, cpu_clock = time.perf_counter, time.thread_time  # wall; this thread's CPU time
    dist.barrier()
    for i in range(args.steps):
        t0, c0 = clock(), cpu_clock()
        loss = forward(shards[i])
        t1, c1 = clock(), cpu_clock()
        p1 = _peak_mib()
        backward(loss)
        t2, c2 = clock(), cpu_clock()
        p2 = _peak_mib()
        step()
        t3, c3 = clock(), cpu_clock()
        peaks.append((p1, p2, _peak_mib()))
        losses.append(loss.detach().float().clone())
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        cpu.append((c1 - c0, c2 - c1, c3 - c2))
        ends.append(t3)
        if i + 1 == args.warmup:
            milestones["warm-up steps"] = _rss_mib()
    milestones["end"] = _rss_mib()

    # One more, untimed probe step: model-state and live tensor bytes after backward and
    # after the optimizer step; with --profile-memory, the allocations of this step.
    prof_ctx = _memory_profiler() if args.profile_memory else contextlib.nullcontext()
    from torch.profiler import record_function

    with prof_ctx as prof:
        with record_function("phase:forward"):
            loss = forward(shards[0])
        with record_function("phase:backward"):
            backward(loss)
        probe = {"after backward": {**_mib(state()), "live_tensors": _live_tensor_mib()}}
        with record_function("phase:step"):
            step()
    probe["after step"] = {**_mib(state()), "live_tensors": _live_tensor_mib()}
    if prof is not None:
        probe["allocations"] = _analyse_allocations(prof)

    # Everything below is outside the timed region.
    warm = args.warmup
    elapsed = torch.tensor([ends[-1] - ends[warm - 1]], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's clock
    loss_t = torch.stack(losses).double()
    dist.all_reduce(loss_t)  # sum of per-rank means of equal shards -> global mean
    loss_t /= world
    per_rank = [None] * world
    dist.all_gather_object(
        per_rank,
        {
            # the peak over the timed run (the probe step below is not part of it)
            "peak_rss_mib": milestones["end"][0],
            "peak_rss_mib_incl_probe": _rss_mib()[0],
            "milestones": milestones,
            "state": state(),
            "probe": probe,
            "peak_rss_mib_after_fwd_bwd_step": peaks,
        },
    )
    report = engine.memory_report() if engine is not None else None
    timed = args.steps - warm
    if rank == 0:

        def medians_ms(rows):
            names = ("forward", "backward", "step")
            out = {
                n: 1e3 * statistics.median(r[k] for r in rows[warm:]) for k, n in enumerate(names)
            }
            out["total"] = 1e3 * statistics.median(sum(r) for r in rows[warm:])
            return out

        result = {
            "framework": name,
            "world_size": world,
            "micro_batch_per_rank": micro,
            "steps": args.steps,
            "warmup_steps": warm,
            "timed_steps": timed,
            "n_params": n_params,
            "torch_threads": torch.get_num_threads(),
            "timed_seconds": float(elapsed),
            "steps_per_s": timed / float(elapsed),
            "samples_per_s": timed * GLOBAL_BATCH / float(elapsed),
            "rank0_step_ms": [[round(1e3 * x, 2) for x in p] for p in phases],
            # medians over the timed steps on rank 0: wall clock, and the main thread's CPU
            # time (less sensitive to other jobs on the machine; excludes gloo's threads)
            "rank0_median_ms": medians_ms(phases),
            "rank0_median_cpu_ms": medians_ms(cpu),
            "losses": [float(x) for x in loss_t],
            "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
            "milestones_per_rank": [r["milestones"] for r in per_rank],
            "model_state_bytes_per_rank": [r["state"] for r in per_rank],
            "probe_per_rank": [r["probe"] for r in per_rank],
            "peak_rss_mib_after_fwd_bwd_step_per_rank": [
                r["peak_rss_mib_after_fwd_bwd_step"] for r in per_rank
            ],
        }
        if report is not None:
            result["memory_report"] = str(report)
            result["memory_report_ratio"] = report.ratio
            result["memory_report_measured"] = report.measured.__dict__
            result["memory_report_formula"] = report.formula.__dict__ if report.formula else None
            result["comm_bytes_per_step"] = comm_bytes
        tmp = args.result + ".part"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result)  # the driver judges the run by this file
    shutdown()


# ---------------------------------------------------------------------------------- driver


def _run_with_retry(name: str, args, tmpdir: str, tag: str, tiny=False) -> dict:
    """One torchrun of ``name`` (retried once without a result); see ``run_worker``."""
    extra = [
        "--steps", str(3 if tiny else args.steps),
        "--warmup", str(1 if tiny else args.warmup),
        "--threads", str(args.threads),
        "--reduce-bucket-size", str(args.reduce_bucket_size),
        "--prefetch-bucket-size", str(args.prefetch_bucket_size),
        "--persistence-threshold", str(args.persistence_threshold),
    ]  # fmt: skip
    if args.profile_memory:
        extra.append("--profile-memory")
    if tiny:
        extra.append("--tiny")
    env = _worker_env()
    if args.malloc_mmap_threshold:
        # glibc: allocations of at least this many bytes get their own mapping and go back
        # to the OS when freed (fixed threshold; the default one adapts upwards to 32 MiB)
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)

    def launch(t: str) -> dict:
        return run_worker(
            HERE, name, extra, nproc=args.nproc, tmpdir=tmpdir, tag=t, timeout=args.timeout,
            env=env,
        )  # fmt: skip

    return run_with_retry(launch, name, tag)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _peaks(result: dict) -> list[float]:
    """Peak RSS of each rank over the timed steps (ru_maxrss when they ended), MiB."""
    return [m["end"][0] for m in result["milestones_per_rank"]]


def _summarise(runs: dict[str, list[dict]], warm: int) -> tuple[dict, dict, dict]:
    summary: dict[str, dict] = {}
    for name, outs in runs.items():
        good = [o["result"] for o in outs if o["ok"]]
        if not good:
            summary[name] = {"ok_runs": 0}
            continue
        world = len(_peaks(good[0]))
        s = {
            "ok_runs": len(good),
            "samples_per_s_median": statistics.median(g["samples_per_s"] for g in good),
            "samples_per_s_all": [round(g["samples_per_s"], 3) for g in good],
            "peak_rss_mib_per_rank_median": [
                statistics.median(_peaks(g)[r] for g in good) for r in range(world)
            ],
            "peak_rss_mib_max_rank_median": statistics.median(max(_peaks(g)) for g in good),
            # params and grads after backward, optimizer state (and masters) after the step
            "model_state_mib_rank0": {
                "params": good[0]["probe_per_rank"][0]["after backward"]["params"],
                "grads": good[0]["probe_per_rank"][0]["after backward"]["grads"],
                "optimizer": good[0]["probe_per_rank"][0]["after step"]["optimizer"],
                "master": good[0]["probe_per_rank"][0]["after step"].get("master", 0.0),
            },
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
        if "memory_report_ratio" in good[0]:
            s["memory_report_ratio"] = good[0]["memory_report_ratio"]
            s["memory_report"] = good[0]["memory_report"]
            s["comm_bytes_last_step"] = good[0]["comm_bytes_per_step"][-1]
        summary[name] = s

    pairs: dict[str, dict] = {}
    for mt, peer in PAIRS:
        a, b = summary.get(mt, {}), summary.get(peer, {})
        if not (a.get("ok_runs") and b.get("ok_runs")):
            continue
        # paired: the same repeat round, so slow background phases hit both
        paired = [
            x["result"]["samples_per_s"] / y["result"]["samples_per_s"]
            for x, y in zip(runs[mt], runs[peer], strict=False)
            if x["ok"] and y["ok"]
        ]
        pairs[f"{mt}/{peer}"] = {
            "ratio": a["samples_per_s_median"] / b["samples_per_s_median"],
            "paired_ratio_median": statistics.median(paired) if paired else None,
            "rss_ratio": a["peak_rss_mib_max_rank_median"] / b["peak_rss_mib_max_rank_median"],
            "rss_delta_mib": a["peak_rss_mib_max_rank_median"] - b["peak_rss_mib_max_rank_median"],
        }

    # loss agreement: every run against the first good run of mt-z1 (or any meshtrain)
    ref_name = next((m for m in MESHTRAIN if summary.get(m, {}).get("ok_runs")), None)
    agreement: dict = {"reference": ref_name}
    if ref_name:
        ref = next(o["result"]["losses"] for o in runs[ref_name] if o["ok"])
        agreement["reference_losses"] = ref
        for name, outs in runs.items():
            rels = [
                [_rel(x, y) for x, y in zip(o["result"]["losses"], ref, strict=True)]
                for o in outs
                if o["ok"]
            ]
            if not rels:
                continue
            agreement[name] = {
                "max_rel_diff_first_steps": max(max(r[:FIRST_STEPS]) for r in rels),
                "max_rel_diff_all_steps": max(max(r) for r in rels),
                "max_abs_diff_all_steps": max(
                    max(abs(x - y) for x, y in zip(o["result"]["losses"], ref, strict=True))
                    for o in outs
                    if o["ok"]
                ),
            }
    return summary, pairs, agreement


def _print_report(summary, pairs, agreement, args) -> None:
    print()
    print(
        f"{args.nproc} ranks, medians of {args.repeats} repeats, {args.steps - args.warmup} "
        "timed steps each; ratio = meshtrain / peer samples/s (>1: meshtrain faster); "
        "paired = median of same-round ratios"
    )
    hdr = (
        f"{'framework':12s} {'samples/s':>9s} {'peak RSS MiB per rank':>22s} "
        f"{'wall fwd/bwd/step ms':>21s} {'cpu fwd/bwd/step ms':>20s} {'state MiB p/g/o/m':>19s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, s in summary.items():
        if not s.get("ok_runs"):
            print(f"{name:12s} FAILED")
            continue
        rss = " / ".join(f"{x:.0f}" for x in s["peak_rss_mib_per_rank_median"])
        ms, cms, st = s["rank0_median_ms"], s["rank0_median_cpu_ms"], s["model_state_mib_rank0"]
        wall = f"{ms['forward']:.0f}/{ms['backward']:.0f}/{ms['step']:.0f}"
        cpu = f"{cms['forward']:.0f}/{cms['backward']:.0f}/{cms['step']:.0f}"
        state = f"{st['params']:.0f}/{st['grads']:.0f}/{st['optimizer']:.0f}/{st['master']:.0f}"
        print(
            f"{name:12s} {s['samples_per_s_median']:9.2f} {rss:>22s} {wall:>21s} {cpu:>20s} "
            f"{state:>19s}"
        )
    print(
        "(state: this rank's parameters / .grad gradients (after backward) / optimizer state / "
        "separate fp32 masters (after the step), MiB, counted from its tensors; meshtrain's from "
        "memory_report; DeepSpeed's gradient buffers are not counted)"
    )
    print()
    hdr = (
        f"{'pair':22s} {'mt s/s':>7s} {'peer s/s':>8s} {'ratio':>6s} {'paired':>6s} "
        f"{'mt RSS':>7s} {'peer RSS':>8s} {'RSS ratio':>9s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for key, p in pairs.items():
        mt, peer = key.split("/")
        a, b = summary[mt], summary[peer]
        paired = p["paired_ratio_median"]
        print(
            f"{key:22s} {a['samples_per_s_median']:7.2f} {b['samples_per_s_median']:8.2f} "
            f"{p['ratio']:6.2f} {paired if paired is not None else float('nan'):6.2f} "
            f"{a['peak_rss_mib_max_rank_median']:7.0f} {b['peak_rss_mib_max_rank_median']:8.0f} "
            f"{p['rss_ratio']:9.2f}"
        )
    print("(RSS: the larger rank's peak RSS, MiB, median over repeats)")
    print()
    if agreement.get("reference"):
        print(
            f"loss agreement vs {agreement['reference']} (relative difference of the global mean loss):"
        )
        for name in summary:
            a = agreement.get(name)
            if a:
                print(
                    f"  {name:12s} first {FIRST_STEPS} steps {a['max_rel_diff_first_steps']:.2e}"
                    f"   all steps {a['max_rel_diff_all_steps']:.2e}"
                    f"   (abs {a['max_abs_diff_all_steps']:.2e})"
                )
    for name in MESHTRAIN:
        s = summary.get(name, {})
        if s.get("memory_report_ratio") is not None:
            comm = {k: f"{v / MiB:.1f}" for k, v in s["comm_bytes_last_step"].items()}
            print(
                f"{name}: memory_report measured/formula = {s['memory_report_ratio']:.4f}; "
                f"comm MiB per step {comm}"
            )


def _driver(args: argparse.Namespace) -> int:
    date = _dt.datetime.now().astimezone()
    names = [p.strip() for p in args.frameworks.split(",") if p.strip()]
    for p in names:
        if p not in ALL:
            raise SystemExit(f"--frameworks: unknown {p!r}; choose from {', '.join(ALL)}")
    if args.steps - args.warmup < 2:
        raise SystemExit("--steps must exceed --warmup by at least 2")
    machine = _machine()
    print(
        f"meshtrain ZeRO vs peers: {args.nproc} ranks x {args.threads} thread, Decoder "
        f"{MODEL}, global batch {GLOBAL_BATCH} x seq {SEQ_LEN}, {args.steps} AdamW steps "
        f"({args.warmup} warm-up), fp32, {args.repeats} repeats; {machine['cpu_count']} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    skipped: dict[str, str] = {}
    runs: dict[str, list[dict]] = {p: [] for p in names}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmpdir:
        ds = [n for n in names if n.startswith("ds-")]
        if ds:
            import importlib.util

            why = None
            if importlib.util.find_spec("deepspeed") is None:
                why = "deepspeed is not installed"
            else:
                print("warming up DeepSpeed (untimed, tiny model: JIT op build) ...", flush=True)
                out = _run_with_retry("ds-z1", args, tmpdir, "warmup", tiny=True)
                if not out["ok"]:
                    why = "deepspeed warm-up run failed:\n" + out["error"][-1500:]
                else:
                    print(f"  warm-up took {out['wall_s']} s", flush=True)
            if why:
                print(f"  skipping {ds}: {why}", flush=True)
                for n in ds:
                    skipped[n] = why
                    names.remove(n)
                    runs.pop(n)
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else list(reversed(names)):
                out = _run_with_retry(name, args, tmpdir, f"r{r}")
                runs[name].append(out)
                if out["ok"]:
                    res = out["result"]
                    ms = res["rank0_median_ms"]
                    rss = "/".join(f"{x:.0f}" for x in res["peak_rss_mib_per_rank"])
                    msg = (
                        f"{res['samples_per_s']:6.2f} samples/s (fwd/bwd/step "
                        f"{ms['forward']:.0f}/{ms['backward']:.0f}/{ms['step']:.0f} ms), "
                        f"peak RSS {rss} MiB"
                    )
                else:
                    msg = "FAILED twice"
                extra = f" [{out['note']}]" if out.get("note") else ""
                extra += " [retried]" if out.get("retried_after") else ""
                print(
                    f"  repeat {r + 1}/{args.repeats} {name:12s} {msg}  "
                    f"load {out['load1_before']:.2f}, {out['wall_s']} s{extra}",
                    flush=True,
                )
    total_s = time.perf_counter() - t_start

    summary, pairs, agreement = _summarise(runs, args.warmup)
    _print_report(summary, pairs, agreement, args)
    for name, why in skipped.items():
        print(f"{name:12s} skipped: {why.splitlines()[0]}")
    load_end = os.getloadavg()
    print(
        f"load average at end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f} "
        f"on {machine['cpu_count']} CPUs; total {total_s:.0f} s. The machine is shared: "
        "expect +-10-20% between runs."
    )
    ok = all(s.get("ok_runs") for s in summary.values())
    worst_first = max(
        (a["max_rel_diff_first_steps"] for k, a in agreement.items() if isinstance(a, dict)),
        default=0.0,
    )
    loss_ok = worst_first <= args.loss_tol
    if not loss_ok:
        print(
            f"WARNING: losses of the first {FIRST_STEPS} steps differ by {worst_first:.2e} "
            f"relative (> {args.loss_tol:g})"
        )

    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        suffix = f"-{args.tag}" if args.tag else ""
        path = (
            Path(args.out)
            if args.out
            else RESULTS / f"zero-{date:%Y-%m-%d-%H%M}-np{args.nproc}{suffix}.json"
        )
        record = {
            "benchmark": "zero",
            "date": date.isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "result", "tiny")},
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
                "timing": f"first {args.warmup} steps excluded; slowest rank's clock",
                "peak_rss": "getrusage(RUSAGE_SELF).ru_maxrss per rank",
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
            "pairs": pairs,
            "loss_agreement": agreement,
            "skipped": skipped,
            "runs": runs,
            "total_seconds": round(total_s, 1),
        }
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"results written to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0 if ok and loss_ok else 1


def _combine(paths: list[str]) -> int:
    """Summarise several result files together (medians over all their repeats)."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    names = list(records[0]["runs"])
    runs = {n: [o for r in records for o in r["runs"].get(n, [])] for n in names}
    a = records[0]["args"]
    args = argparse.Namespace(
        nproc=a["nproc"],
        steps=a["steps"],
        warmup=a["warmup"],
        repeats=sum(len(r["runs"][names[0]]) for r in records),
    )
    for r in records[1:]:
        same = {
            k: r["args"].get(k) == a.get(k)
            for k in (
                "nproc",
                "steps",
                "warmup",
                "reduce_bucket_size",
                "prefetch_bucket_size",
                "persistence_threshold",
                "malloc_mmap_threshold",
            )
        }
        if not all(same.values()):
            print(
                f"note: settings differ between result files: {[k for k, v in same.items() if not v]}"
            )
    print(f"combined: {', '.join(paths)}")
    summary, pairs, agreement = _summarise(runs, args.warmup)
    _print_report(summary, pairs, agreement, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (data-parallel size)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    ap.add_argument("--repeats", type=int, default=2, help="runs per framework (median taken)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument(
        "--frameworks",
        default=",".join(ALL),
        help="comma-separated subset of: " + ", ".join(ALL),
    )
    ap.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=10_000_000,
        help="meshtrain and DeepSpeed reduce_bucket_size (and DeepSpeed allgather_bucket_size)",
    )
    ap.add_argument(
        "--prefetch-bucket-size",
        type=int,
        default=5_000_000,
        help="stage3_prefetch_bucket_size (meshtrain and DeepSpeed)",
    )
    ap.add_argument(
        "--persistence-threshold",
        type=int,
        default=100_000,
        help="stage3_param_persistence_threshold (meshtrain and DeepSpeed)",
    )
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ for the workers (e.g. 1048576): peak RSS then follows "
        "live tensor bytes instead of glibc heap retention (diagnosis)",
    )
    ap.add_argument("--timeout", type=int, default=300, help="seconds per torchrun")
    ap.add_argument(
        "--loss-tol",
        type=float,
        default=1e-4,
        help=f"max relative loss difference vs meshtrain over the first {FIRST_STEPS} steps",
    )
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument(
        "--combine",
        nargs="+",
        metavar="RESULT_JSON",
        default=None,
        help="run nothing: print the report over the repeats of these result files together",
    )
    ap.add_argument("--out", default=None, help="result JSON path (default: benchmarks/results/)")
    ap.add_argument("--no-save", action="store_true", help="do not write the result JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--profile-memory",
        action="store_true",
        help="profile the tensor allocations of one extra, untimed step (slow; diagnosis)",
    )
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.combine:
        return _combine(args.combine)
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
