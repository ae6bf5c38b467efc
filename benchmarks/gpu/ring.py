"""Context parallelism, cp 2 on one GPU (issue 48): one causal attention layer's forward +
backward, bf16, batch 1, 16 heads x 128 head dim, at 8k, 16k and 32k total tokens, by

=========  ==========================================================================
ring       ``meshtrain.parallel.context.ring.ring_attention`` as it is today: on CUDA its
           per-block kernel is the fp32 block math of ``blocks.py`` (matmul, logsumexp,
           exp in fp32, pieces of ``SCORE_ELEMENTS`` scores; no flash kernel returning the
           log-sum-exp yet), recorded as ``kernel``
a2a        ``meshtrain.parallel.context.all_to_all.ulysses_attention`` (DeepSpeed Ulysses):
           two all-to-alls around one SDPA call (flash) on the whole sequence, half the heads
torch      the peer, ``torch.distributed.tensor.experimental.context_parallel`` (its ring
           over the flash/efficient SDPA ops, on a 2-rank ``DeviceMesh``); on gloo it may
           fail, and its error is the result
=========  ==========================================================================

Two ranks share ``cuda:0`` in child processes (``python -m benchmarks.gpu.ring``, the
torchrun environment), restarted after a crash or hang (the job it was in is recorded as
such; a method that failed is not tried at longer lengths). Backend: gloo, with meshtrain's
host staging of CUDA tensors (``comm``), unless the multirank section found nccl right for
every op and the cp layouts on the shared GPU (then nccl). Every rank holds the
load-balanced layout (chunks ``i`` and ``2C-1-i``; torch's head-tail load balancer is the
same layout), so each rank's output and gradients are compared with its rows of one
process's SDPA on the whole sequence (``err``: max abs over both ranks; ``grad_err``: of
dq, dk, dv). Per point: ms per forward + backward (the slower rank's, median of 3 after 1
warm-up, a barrier before each), ``peak_gib`` per rank (``max_memory_allocated``, the
larger rank; torch's buffers keep their whole-sequence storage inside its context, so also
``added_gib``: peak minus what was allocated before the timed iterations), and
``sdpa_1proc_ms`` (one process, whole sequence, rank 0 alone). Ratios ``ring/a2a`` and
``ring/torch`` per length (> 1: ring slower). Points go to ``OUT/ring/points.jsonl`` as they
finish; a length that would end past the budget is skipped, and so are the longer ones.

Both ranks' kernels share one GPU, so a point's time is the whole layer's work on one
device plus the communication (gloo: device -> host -> device copies), not a 2-GPU
speed-up; what it compares is the three methods on the same footing (and each against
``sdpa_1proc_ms``: the cost of splitting at all).

Dry run (CPU, gloo, 2 heads x 16, 128 and 256 tokens): the GPU's paths are forced (ring's
fp32 block math instead of the CPU flash op, the a2a's SDPA seam instead of its CPU flash
function, host staging of every op); torch's context parallelism has no CPU sharding rule
for SDPA, so its error is recorded there.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.gpu.rank_pair import Records, fault, read_records, start, stderr_tail, stop

ROWS = (
    "backend",
    "kernel",
    "lengths_run",
    "ring_over_a2a",
    "ring_over_torch",
    "worst_err",
    "ring_peak_gib",
    "torch_error",
)

METHODS = ("ring", "a2a", "torch")
FULL = dict(lengths=(8192, 16384, 32768), heads=16, head_dim=128)
DRY = dict(lengths=(128, 256), heads=2, head_dim=16)
WARMUP, ITERS = 1, 3
# seconds without a record before a group counts as hung: its start-up, one job, one of
# torch's jobs (gloo over CUDA tensors may hang there: less of the budget spent waiting)
START_S, JOB_S, TORCH_JOB_S = 45.0, 30.0, 20.0
DRY_START_S, DRY_JOB_S = 40.0, 20.0
KERNELS = {
    "_Math": "fp32 block math (blocks.py: matmul + logsumexp + exp in fp32, no LSE kernel)",
    "_FlashCPU": "aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)",
}


# ------------------------------------------------------------------------ the children


def _sdpa_kernels(torch, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type == "cuda":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


def _inputs(torch, length: int, spec: dict, device):
    """Whole-sequence ``Q, K, V`` and the output's gradient ``G``, ``[1, H, L, hd]`` bf16,
    the same on both ranks (seeded by the length)."""
    gen = torch.Generator(device=device).manual_seed(length)
    shape = (1, spec["heads"], length, spec["head_dim"])
    return [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(4)]  # fmt: skip


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(torch, dist, device, step) -> tuple[list[float], float | None, float | None]:
    """``step()`` WARMUP + ITERS times, a barrier before each: (seconds of the timed ones,
    peak GiB, peak minus the allocation before the timed ones, GiB)."""
    times, base = [], None
    for i in range(WARMUP + ITERS):
        if i == WARMUP and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        dist.barrier()
        _sync(torch, device)
        t0 = time.perf_counter()
        step()
        _sync(torch, device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    if device.type != "cuda":
        return times, None, None
    peak = torch.cuda.max_memory_allocated()
    return times, peak / 2**30, (peak - base) / 2**30


def _errors(mine: dict, ref: dict | None) -> dict:
    """Max abs differences of this rank's output and gradients from its rows of the
    one-process reference (both on the CPU)."""
    if not ref:
        return {"err": None, "note": "no reference at this length"}
    out = {"err": float((mine["out"].float() - ref["out"].float()).abs().max())}
    if "out32" in ref:
        out["err_fp32"] = float((mine["out"].float() - ref["out32"]).abs().max())
    out["grad_err"] = max(float((mine[n].float() - ref[n].float()).abs().max())
                          for n in ("dq", "dk", "dv"))  # fmt: skip
    return out


def _reference(torch, F, rank, length, spec, device, refs) -> tuple:
    """This rank's rows of one process's SDPA output and gradients over the whole sequence,
    into ``refs[length]`` (on the CPU; a group restarted after a failure computes them
    again); returns the whole-sequence tensors and the fp32 check's figures."""
    from meshtrain.parallel.context.layout import shard

    Q, K, V, G = _inputs(torch, length, spec, device)
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    with _sdpa_kernels(torch, device):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(G)
    refs.clear()
    refs[length] = {n: shard(t.detach(), rank, 2, dim=2).cpu()
                    for n, t in (("out", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}  # fmt: skip
    res: dict = {}
    try:  # the fp32 truth (the efficient kernel on CUDA): how far bf16 SDPA itself is
        with torch.no_grad(), _sdpa_kernels(torch, device):
            o32 = F.scaled_dot_product_attention(Q.float(), K.float(), V.float(), is_causal=True)
        refs[length]["out32"] = shard(o32, rank, 2, dim=2).cpu()
        del o32
        res["err_fp32"] = float((refs[length]["out"].float() - refs[length]["out32"]).abs().max())
    except Exception as exc:  # noqa: BLE001 - a detail of the result
        res["fp32_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return (q, k, v, G), res


def _job_sdpa(torch, dist, F, rank, length, spec, device, refs) -> dict:
    """The reference (both ranks, ``_reference``) and, on rank 0 alone, one process's SDPA
    forward + backward time over the whole sequence."""
    (q, k, v, G), res = _reference(torch, F, rank, length, spec, device, refs)
    dist.barrier()
    if rank == 0:

        def step():
            q.grad = k.grad = v.grad = None
            with _sdpa_kernels(torch, device):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(G)

        times = []
        for i in range(WARMUP + ITERS):
            _sync(torch, device)
            t0 = time.perf_counter()
            step()
            _sync(torch, device)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        res["ms"] = [round(t * 1e3, 3) for t in times]
    dist.barrier()
    return res


def _job_meshtrain(torch, dist, method, rank, length, spec, device, group, refs) -> dict:
    from meshtrain.parallel.context.all_to_all import ulysses_attention
    from meshtrain.parallel.context.layout import shard
    from meshtrain.parallel.context.ring import ring_attention

    full = _inputs(torch, length, spec, device)
    q, k, v, g = (shard(t, rank, 2, dim=2).contiguous() for t in full)
    del full
    for t in (q, k, v):
        t.requires_grad_()
    fn = ring_attention if method == "ring" else ulysses_attention
    if device.type == "cuda":
        torch.cuda.empty_cache()
    box = {}

    def step():
        q.grad = k.grad = v.grad = None
        box.pop("o", None)
        with _sdpa_kernels(torch, device):
            o = fn(q, k, v, group)
            o.backward(g)
        box["o"] = o.detach()

    times, peak, added = _timed(torch, dist, device, step)
    mine = {"out": box["o"].cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}
    return {"ms": [round(t * 1e3, 3) for t in times], "peak_gib": peak, "added_gib": added,
            **_errors(mine, refs.get(length))}  # fmt: skip


def _job_torch(torch, dist, F, rank, length, spec, device, meshes, refs) -> dict:
    """torch's own context parallelism: ``context_parallel(mesh, buffers=[q, k, v, g])``
    shards the whole-sequence buffers in place (head-tail layout), F.sdpa inside is its
    ring attention."""
    from torch.distributed.tensor.experimental import context_parallel

    res: dict = {}
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options

        res["rotate_method"] = str(getattr(_cp_options, "rotate_method", None))
    except Exception as exc:  # noqa: BLE001 - a detail of the result
        res["rotate_method"] = f"unknown ({type(exc).__name__})"
    if "mesh" not in meshes:
        from torch.distributed.device_mesh import init_device_mesh

        meshes["mesh"] = init_device_mesh(device.type, (2,))
    mesh = meshes["mesh"]
    q, k, v, g = _inputs(torch, length, spec, device)
    box = {}
    with context_parallel(mesh, buffers=[q, k, v, g], buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers={q, k, v, g}):  # fmt: skip
        for t in (q, k, v):
            t.requires_grad_()

        def step():
            q.grad = k.grad = v.grad = None
            box.pop("o", None)
            with _sdpa_kernels(torch, device):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(g)
            box["o"] = o.detach()

        times, peak, added = _timed(torch, dist, device, step)
        mine = {"out": box["o"].cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(),
                "dv": v.grad.cpu()}  # fmt: skip
    res.update(ms=[round(t * 1e3, 3) for t in times], peak_gib=peak, added_gib=added,
               **_errors(mine, refs.get(length)))  # fmt: skip
    return res


def child(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshtrain.distributed.env import init_distributed
    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.context import all_to_all, ring

    rank = int(os.environ["RANK"])
    log = Records(spec["records"], rank, spec["attempt"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    if spec["dry"]:  # the GPU's paths on the CPU (module docstring)
        ring._backend = lambda q: ring._Math()
        all_to_all._flash_fits = lambda q: False
    init_distributed(timeout_minutes=spec["pg_timeout_min"], backend=spec["backend"])
    group = Topology(cp=2, device=device).cp_group
    probe = torch.zeros(1, 2, 2, 2, device=device, dtype=torch.bfloat16)
    kind = type(ring._backend(probe)).__name__
    log(event="ready", backend=dist.get_backend(), kernel=kind,
        a2a_kernel="CPU flash function" if all_to_all._flash_fits(probe) else
        "SDPA seam (F.scaled_dot_product_attention)",
        host_staging=comm_staged(group, probe), torch=torch.__version__,
        fp32_matmul=torch.get_float32_matmul_precision())  # fmt: skip
    refs: dict = {}
    meshes: dict = {}
    last: dict = {}  # method -> (length, seconds) of its last job: the next one's estimate
    out_of_time = False
    for job in spec["jobs"]:
        method, length = job.split(" ")[0], int(job.split(" ")[1])
        guess = 0.0
        if method in last:
            n, s = last[method]
            guess = s * (length / n) ** 2
        decision = [out_of_time or time.time() + guess > spec["deadline_unix"]]
        dist.broadcast_object_list(decision, src=0)  # both ranks decide alike
        if decision[0]:
            out_of_time = True
            log(job=job, event="done", ok=None,
                skipped=f"budget: ~{guess:.1f} s would end past the section's budget")  # fmt: skip
            continue
        log(job=job, event="enter")
        fault("RING_FAULT", job, rank)
        t0 = time.perf_counter()
        try:
            if method != "sdpa" and length not in refs:  # a fresh group after a failure
                _reference(torch, F, rank, length, spec, device, refs)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if method == "sdpa":
                res = _job_sdpa(torch, dist, F, rank, length, spec, device, refs)
            elif method == "torch":
                res = _job_torch(torch, dist, F, rank, length, spec, device, meshes, refs)
            else:
                res = _job_meshtrain(torch, dist, method, rank, length, spec, device, group,
                                     refs)  # fmt: skip
            seconds = time.perf_counter() - t0
            last[method] = (length, seconds)
            log(job=job, event="done", ok=True, s=round(seconds, 3), **res)
        except Exception as exc:  # the verdict is the record, then the group ends
            log(job=job, event="done", ok=False, error=f"{type(exc).__name__}: {exc}"[:800],
                traceback=traceback.format_exc(limit=-4)[-1500:])  # fmt: skip
            raise  # the peer may be inside a collective: the parent starts a fresh group
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    log(event="exit")
    dist.destroy_process_group()


def comm_staged(group, probe) -> bool | None:
    try:
        from meshtrain.distributed.comm import host_staged

        return bool(host_staged(group, probe))
    except Exception:  # noqa: BLE001 - a detail of the result
        return None


# ------------------------------------------------------------------------ the parent


def _start(spec: dict, work: Path, dry: bool) -> list:
    spec_path = work / f"spec_{spec['attempt']}.json"
    spec_path.write_text(json.dumps(spec))
    return start(["benchmarks.gpu.ring", "child", str(spec_path)], work, spec["attempt"], dry)


def run_groups(ctx, base: dict, jobs: list[str], records: Path, work: Path, deadline: float,
               on_done) -> dict:  # fmt: skip
    """``jobs`` on 2-rank groups: a group that crashes or hangs is killed, the job it was
    in recorded as failed, and a fresh group takes the jobs after it (those of a method
    that failed are not run) until ``deadline``; ``on_done(job, result)`` as each ends."""
    results: dict = {}
    remaining = list(jobs)
    stamp = time.time_ns() // 10**6 % 10**9
    start_s, job_s = (DRY_START_S, DRY_JOB_S) if ctx.dry else (START_S, JOB_S)
    torch_s = min(job_s, TORCH_JOB_S)
    tries = 0

    def finish(job, res):
        results[job] = res
        on_done(job, res)

    def collect(attempt):
        recs = read_records(records, attempt)
        for job in remaining:
            if job in results:
                continue
            done = {x["rank"]: x for x in recs if x.get("job") == job and x["event"] == "done"}
            if len(done) == 2:
                finish(job, {f"rank{k}": v for k, v in sorted(done.items())})
        return recs

    while remaining and time.perf_counter() < deadline - 3:
        tries += 1
        attempt = f"{stamp}_{tries}"
        left_s = deadline - time.perf_counter()
        spec = {**base, "jobs": remaining, "attempt": attempt, "records": str(records),
                "deadline_unix": time.time() + left_s - 2}  # fmt: skip
        procs = _start(spec, work, ctx.dry)
        launched = last = time.perf_counter()
        seen, failure = 0, None
        while True:
            time.sleep(0.1)
            recs = collect(attempt)
            now = time.perf_counter()
            if len(recs) > seen:
                seen, last = len(recs), now
            rcs = [p.poll() for p, _ in procs]
            entered = [x["job"] for x in recs if x["event"] == "enter"]
            limit = torch_s if entered and entered[-1].startswith("torch ") else job_s
            if not any(x["event"] == "ready" for x in recs):
                limit = start_s
            if all(rc is not None for rc in rcs):
                failure = f"a rank exited {rcs}" if any(rcs) else None
                break
            if any(rc not in (None, 0) for rc in rcs):
                time.sleep(1.0)  # let the other write what it saw
                failure = f"a rank died (exit {rcs})"
                break
            if now - last > limit:
                failure = f"no progress for {limit:.0f} s (hung)"
                break
            if now > deadline:
                failure = "the section's time ran out"
                break
        rcs = stop(procs)
        recs = collect(attempt)
        left = [j for j in remaining if j not in results]
        if left and failure is None:
            failure = "the group ended with jobs left"
        if left:
            current = left[0]
            entered = [x for x in recs if x.get("job") == current]
            if entered or not any("job" in x for x in recs):
                # the job it was in (or, before any job, every job left) failed that way
                why = failure if entered else f"{failure} before the first job"
                for job in left[:1] if entered else left:
                    half = {f"rank{x['rank']}": x for x in entered if x["event"] == "done"}
                    finish(job, {"failed": why, "exit": rcs, "stderr": stderr_tail(work, attempt),
                                 "seconds": round(time.perf_counter() - launched, 1), **half})  # fmt: skip
        failed = {j.split(" ")[0]: j for j, r in results.items() if not _ok(r)}
        remaining = []
        for job in left:
            if job in results:
                continue
            method = job.split(" ")[0]
            if method in failed and method != "sdpa":
                finish(job, {"skipped": f"{method} failed at {failed[method].split(' ')[1]}"})
            else:
                remaining.append(job)
    for job in remaining:
        finish(job, {"skipped": "the section's time ran out"})
    return results


def _ok(res: dict) -> bool:
    if "skipped" in res:
        return True
    if "failed" in res:
        return False
    return all(res.get(f"rank{k}", {}).get("ok") is not False for k in (0, 1))


def _point(job: str, res: dict) -> dict:
    """One summary row from both ranks' records of ``job``."""
    method, length = job.split(" ")[0], int(job.split(" ")[1])
    row: dict = {"method": method, "tokens": length}
    if "skipped" in res or "failed" in res:
        row.update({k: v for k, v in res.items() if k in ("skipped", "failed", "stderr")})
        recs = [res[k] for k in ("rank0", "rank1") if k in res]
    else:
        recs = [res["rank0"], res["rank1"]]
        skipped = [r.get("skipped") for r in recs if r.get("skipped")]
        if skipped:
            row["skipped"] = skipped[0]
            return row
    errors = [r.get("error") for r in recs if r.get("error")]
    if errors:
        row["error"] = errors[0]
        row["traceback"] = next((r.get("traceback") for r in recs if r.get("traceback")), None)
        return row
    if len(recs) < 2 or "failed" in row:
        return row
    if method == "sdpa":
        row["ms"] = statistics.median(recs[0]["ms"]) if recs[0].get("ms") else None
        vals = [r.get("err_fp32") for r in recs if r.get("err_fp32") is not None]
        row["err_fp32"] = max(vals) if len(vals) == 2 else None
        row["fp32_error"] = recs[0].get("fp32_error")
        return row
    # per iteration the slower rank; the median of those
    per_iter = [max(a, b) for a, b in zip(recs[0]["ms"], recs[1]["ms"], strict=True)]
    row["ms"] = round(statistics.median(per_iter), 3)
    for key in ("peak_gib", "added_gib"):
        vals = [r.get(key) for r in recs if r.get(key) is not None]
        row[key] = round(max(vals), 3) if vals else None
    for key in ("err", "grad_err", "err_fp32"):
        vals = [r.get(key) for r in recs if r.get(key) is not None]
        row[key] = max(vals) if len(vals) == 2 else None
    if recs[0].get("rotate_method"):
        row["rotate_method"] = recs[0]["rotate_method"]
    return row


def _backend(ctx) -> tuple[str, str]:
    """nccl where the multirank section found it right on the shared GPU (every op the
    layouts use, and the cp layouts themselves), else gloo staged through host memory."""
    if not ctx.cuda:
        return "gloo", "dry run: CPU tensors over gloo, staged all the same"
    mr = ctx.results.get("multirank") or {}
    cp_rows = [r for r in mr.get("layouts", []) if " cp2 " in f" {r.get('layout', '')} "]
    cp_ok = bool(cp_rows) and all(r.get("ok") and r.get("backend") == "nccl" for r in cp_rows)
    if mr.get("layout_backend") == "nccl" and cp_ok:
        return "nccl", "multirank: nccl passed every op and the cp2 layouts on the shared GPU"
    why = "multirank did not run" if not mr else "multirank did not find nccl right for cp"
    return "gloo", f"{why}: gloo, CUDA tensors staged through host memory by comm"


def section(ctx) -> dict:
    t0 = time.perf_counter()
    sizes = DRY if ctx.dry else FULL
    budget = float(getattr(ctx, "budget_s", 90.0))
    budget = min(budget, 40.0 if ctx.dry else 90.0)
    deadline = t0 + budget
    out_dir = ctx.out / "ring"
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("*.jsonl"):
        f.unlink()
    work = Path(tempfile.mkdtemp(prefix="ring-"))
    backend, why = _backend(ctx)
    result: dict = {"backend": backend, "backend_why": why, "device": str(ctx.device),
                    "dtype": "bf16", "batch": 1, "heads": sizes["heads"],
                    "head_dim": sizes["head_dim"], "cp": 2, "budget_s": budget,
                    "timing": f"ms per fwd+bwd, slower rank, median of {ITERS} after "
                              f"{WARMUP} warm-up"}  # fmt: skip
    if ctx.dry:
        result["dry_paths"] = "GPU paths forced: ring fp32 block math, a2a SDPA seam, staging"
    jobs = [f"{m} {n}" for n in sizes["lengths"] for m in ("sdpa", *METHODS)]
    points: list[dict] = []
    summary = out_dir / "points.jsonl"

    def done(job, res):
        row = _point(job, res)
        points.append(row)
        with open(summary, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    base = {"backend": backend, "device": str(ctx.device), "dry": ctx.dry,
            "pg_timeout_min": 1.0, **sizes}  # fmt: skip
    try:
        run_groups(ctx, base, jobs, out_dir / "records.jsonl", work, deadline, done)
        never = all("before the first job" in str(p.get("failed", "")) for p in points)
        if backend == "nccl" and points and never and deadline - time.perf_counter() > 20:
            # nccl passed multirank's probe but no group of it got to a job: gloo, staged
            result["nccl_try"] = list(points)
            points.clear()
            backend = base["backend"] = result["backend"] = "gloo"
            run_groups(ctx, base, jobs, out_dir / "records.jsonl", work, deadline, done)
        ready = [r for r in read_records(out_dir / "records.jsonl") if r.get("event") == "ready"]
        if ready:
            kind = ready[0].get("kernel")
            result["kernel"] = KERNELS.get(kind, kind)
            result["ring_backend_class"] = kind
            result["a2a_kernel"] = ready[0].get("a2a_kernel")
            result["host_staging"] = ready[0].get("host_staging")
            result["pg_backend"] = ready[0].get("backend")
            result["child_torch"] = ready[0].get("torch")
            result["fp32_matmul"] = ready[0].get("fp32_matmul")  # "highest": no TF32
        result["groups_started"] = len({r.get("attempt") for r in ready})
    except Exception as exc:  # noqa: BLE001 - the points so far are the result
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=-4)[-1500:]
    result.setdefault("kernel", f"{KERNELS['_Math']} (not confirmed: no group started)")
    result["points"] = points
    by = {(p["method"], p["tokens"]): p for p in points}
    ring_a2a, ring_torch, lengths, errs = {}, {}, [], []
    for n in sizes["lengths"]:
        r, a, t = (by.get((m, n), {}) for m in METHODS)
        if any(p.get("ms") for p in (r, a, t)):
            lengths.append(n)
        if r.get("ms") and a.get("ms"):
            ring_a2a[n] = round(r["ms"] / a["ms"], 3)
        if r.get("ms") and t.get("ms"):
            ring_torch[n] = round(r["ms"] / t["ms"], 3)
        errs += [(f"{m} {n}", p["err"]) for m, p in zip(METHODS, (r, a, t), strict=True)
                 if p.get("err") is not None]  # fmt: skip
    result["ratios"] = {"ring/a2a": ring_a2a, "ring/torch": ring_torch}
    result["lengths_run"] = ",".join(str(n) for n in lengths) or None
    result["ring_over_a2a"] = ", ".join(f"{n}: {v}" for n, v in ring_a2a.items()) or None
    result["ring_over_torch"] = ", ".join(f"{n}: {v}" for n, v in ring_torch.items()) or None
    if errs:
        worst = max(errs, key=lambda e: e[1])
        result["worst_err"] = f"{worst[1]:.3g} ({worst[0]})"
    peaks = [p["peak_gib"] for p in points if p["method"] == "ring" and p.get("peak_gib")]
    result["ring_peak_gib"] = max(peaks) if peaks else None
    result["table"] = {
        m: {p["tokens"]: {k: p.get(k) for k in ("ms", "peak_gib", "added_gib", "err",
                                                  "err_fp32") if p.get(k) is not None}
            for p in points if p["method"] == m and p.get("ms")}
        for m in ("sdpa", *METHODS)
    }  # fmt: skip
    torch_errs = [p.get("error") or p.get("failed") for p in points
                  if p["method"] == "torch" and (p.get("error") or p.get("failed"))]  # fmt: skip
    result["torch_error"] = torch_errs[0][:300] if torch_errs else None
    meshtrain_ok = [p for p in points if p["method"] in ("ring", "a2a") and p.get("ms")]
    result["ok"] = bool(meshtrain_ok) and not any(
        p.get("error") or p.get("failed") for p in points if p["method"] in ("ring", "a2a")
    )
    result["seconds"] = round(time.perf_counter() - t0, 1)
    shutil.rmtree(work, ignore_errors=True)  # what failed is quoted in the points
    return result


def _child_main(argv: list[str]) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    mode, spec_path = argv
    if mode != "child":
        raise SystemExit(f"unknown mode {mode!r}")
    child(json.loads(Path(spec_path).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
