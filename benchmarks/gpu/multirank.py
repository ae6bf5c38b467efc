"""Multi-rank on one GPU (issue 48): 2 ranks sharing ``cuda:0``, and whether meshtrain's
layouts train there like one process.

Measures, in 2-process groups started here (``python -m benchmarks.gpu.multirank``, the
torchrun environment, each group killed at its deadline):

(a) **the backend probe**: raw ``torch.distributed`` on 2 ranks of the one device, one
    pair per backend (nccl, then gloo; the dry run has no nccl): all_reduce, broadcast,
    all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, then (gloo only)
    meshtrain's ``comm`` staged through host memory on the same CUDA tensors, then the
    dangerous ones, send/recv and batch_isend_irecv (gloo's send of a CUDA tensor killed
    the process in the first probe). Every op's verdict is appended to
    ``OUT/multirank/probe_<backend>.jsonl`` by each rank as it finishes; a rank that dies or
    hangs is killed, the op it was in is recorded as such, and the pair restarts after it
    while the backend's ~25 s last.
(b) **the layouts**: tp 2, pp 2, cp 2 (ring and all-to-all), ZeRO-3 dp 2 on a tiny
    transformers Llama, the same and ep 2 (dp 2) on a tiny Mixtral, 10 fp32 AdamW steps
    each through the Engine on one 2-rank group (a fresh engine per layout; a layout that
    crashes or hangs is recorded and the group restarts after it), against the peer: one
    process in plain PyTorch on the same device (this process). Backend: nccl where the
    probe found every op meshtrain uses correct on the shared GPU, else gloo (``comm``
    stages its CUDA tensors through host memory). Each result goes to
    ``OUT/multirank/layouts.jsonl`` as it is compared.

Tolerance (fp32, TF32 off on both sides): the two sides differ only in the order of fp32
sums (tp partial sums, cp's attention merge, the experts' all-to-all regrouping, ZeRO's
reduce-scatter, and on the GPU cuBLAS picking other kernels for other shapes and atomics
in index backward passes), so the suite's trajectory rule applies (``tests/tolerance.py``,
row 3): ``4 u (sqrt(64) + 48 sum(lr) / 0.02)`` with ``u = 2^-24``, 10 steps at lr 1e-2:
5.9e-5, for the per-step losses (relative) and the whole model (normwise). TF32 would
round GEMM inputs to 10 mantissa bits (u = 2^-11) and void the bound, so it is off.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.gpu.rank_pair import Records, fault, read_records, start, stderr_tail, stop

ROWS = (
    "layout_backend",
    "nccl_ops_ok",
    "gloo_ops_ok",
    "layouts_passed",
    "layouts_run",
    "worst_loss_rel",
    "worst_model_rel",
    "bound",
    "peak_gib",
)

STEPS = 10
LR = 1e-2
WEIGHT_DECAY = 0.01
SEQ, ROWS_PER_MICRO, MICRO, VOCAB = 16, 4, 2, 64
# the trajectory bound (module docstring; tests/tolerance.py: MARGIN, ADAM_ULPS, WIDTH,
# INIT_STD)
BOUND = 4.0 * 2.0**-24 * (math.sqrt(64) + 48.0 * LR * STEPS / 0.02)
RAW_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
           "all_to_all_single")  # fmt: skip
COMM_OPS = ("comm_all_reduce", "comm_reduce_scatter_bucket", "comm_all_gather_bucket",
            "comm_all_to_all", "comm_broadcast", "comm_batch_p2p")  # fmt: skip
P2P_OPS = ("send_recv", "batch_isend_irecv")
# what meshtrain's layouts call on the backend: all must pass for nccl to run them
NEEDED = (*RAW_OPS, "batch_isend_irecv")
# (model, label, Layout fields)
LAYOUTS = (
    ("llama", "tp2", dict(tp=2)),
    ("llama", "pp2", dict(pp=2)),
    ("llama", "cp2 ring", dict(cp=2, cp_method="ring")),
    ("llama", "cp2 all_to_all", dict(cp=2, cp_method="all_to_all")),
    ("llama", "dp2 z3", dict(dp=2, stage=3)),
    ("mixtral", "tp2", dict(tp=2)),
    ("mixtral", "pp2", dict(pp=2)),
    ("mixtral", "cp2 ring", dict(cp=2, cp_method="ring")),
    ("mixtral", "cp2 all_to_all", dict(cp=2, cp_method="all_to_all")),
    ("mixtral", "dp2 ep2", dict(dp=2, ep=2)),
    ("mixtral", "dp2 z3", dict(dp=2, stage=3)),
)
# stderr lines that say nothing about a failure: warnings and torch's W-level log lines
PROBE_S = 25.0  # each backend's pair, restarts included
PROBE_START_S = 20.0  # imports, CUDA and the process group, before the first op
PROBE_OP_S = 8.0
LAYOUT_START_S = 40.0
LAYOUT_S = 30.0  # one layout's 10 steps (the dry run: twice)


# ------------------------------------------------------------------------ the models


def build(name: str, seed: int = 0):
    """The test matrix's tiny models (``tests/layouts/matrix.py``), fp32, seeded weights:
    Llama 4 layers, width 32, 4 heads and 4 kv heads, vocab 64; Mixtral the same with 8
    experts top-2, router auxiliary loss 0.02, weights N(0, 0.1) and routers N(0, 0.5)
    (routing that differs between tokens, so no near-tie flips an expert)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    if name == "llama":
        cfg = transformers.LlamaConfig(**common, intermediate_size=64, tie_word_embeddings=False)
        cfg.architectures = ["LlamaForCausalLM"]
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.MixtralConfig(
        **common, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "gate" in n else 0.1))
    return model


def micro_batches(step: int, dp: int, replica: int | None) -> list[dict]:
    """The step's ``MICRO`` micro-batches of ``ROWS_PER_MICRO`` rows over all replicas;
    ``replica``: that replica's rows (None: all of them)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(MICRO):
        ids = torch.randint(0, VOCAB, (ROWS_PER_MICRO, SEQ), generator=g)
        if replica is not None:
            rows = ROWS_PER_MICRO // dp
            ids = ids[replica * rows : (replica + 1) * rows]
        out.append({"input_ids": ids, "labels": ids})
    return out


def layout_config(name: str, fields: dict) -> dict:
    from meshtrain.plan.layout import Layout

    dp = fields.get("dp", 1)
    layout = Layout(**fields, micro_batch=ROWS_PER_MICRO // dp, grad_accum=MICRO)
    out = layout.config("fp32")
    out.pop("train_batch_size", None)  # derived: micro x accumulation x dp
    out["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
    out["steps_per_print"] = 10**9
    if name == "mixtral":
        out["loss"] = {"global_aux_loss": True}  # the aux loss over every replica's tokens
    return out


def exact_fp32(torch) -> tuple:
    """TF32 off (module docstring); returns the settings it replaced."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return old


def reference(name: str, device) -> tuple[list[float], dict]:
    """One process, plain PyTorch: each step every replica's micro-batches, ``loss /
    MICRO`` backward, one ``torch.optim.AdamW`` step."""
    import torch

    with torch.random.fork_rng(devices=[]):
        model = build(name).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for batch in micro_batches(step, 1, None):
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            (loss / MICRO).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / MICRO)
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def compare(got: tuple[list[float], dict], ref: tuple[list[float], dict]) -> dict:
    losses, state = got
    ref_losses, ref_state = ref
    missing = sorted(set(ref_state) - set(state))
    if missing:
        return {"ok": False, "error": f"parameters missing from the layout: {missing[:5]}"}
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    diff = sum(float((state[k].double() - v.double()).pow(2).sum()) for k, v in ref_state.items())
    norm = sum(float(v.double().pow(2).sum()) for v in ref_state.values())
    model_rel = math.sqrt(diff / norm)
    return {
        "ok": loss_rel <= BOUND and model_rel <= BOUND,
        "max_loss_rel": loss_rel,
        "max_loss_abs": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "model_rel": model_rel,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


# ------------------------------------------------------------------------ the children


def _probe(op: str, r: int, device, host_staging: bool | None):
    """Run probe ``op`` on this rank of 2; return (correct, what it got)."""
    import torch
    import torch.distributed as dist

    def full(n, v, dtype=torch.float32):
        return torch.full((n,), float(v), dtype=dtype, device=device)

    def ar(n):
        return torch.arange(n, dtype=torch.float32, device=device)

    peer = 1 - r
    if op.startswith("comm_"):
        from meshtrain.distributed import comm
        from meshtrain.distributed.comm_stats import CommStats

        g = comm.Group("world", dist.group.WORLD, (0, 1), r, CommStats(), host_staging)
    if op == "all_reduce":
        x = full(4, r + 1)
        dist.all_reduce(x)
        want = [3.0] * 4
    elif op == "broadcast":
        x = full(4, 10 * r + 7)
        dist.broadcast(x, src=1)
        want = [17.0] * 4
    elif op == "all_gather_into_tensor":
        x = torch.empty(6, device=device)
        dist.all_gather_into_tensor(x, full(3, r + 1))
        want = [1.0] * 3 + [2.0] * 3
    elif op == "reduce_scatter_tensor":
        x = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(x, ar(4) + 10 * r)
        want = [[10.0, 12.0], [14.0, 16.0]][r]
    elif op == "all_to_all_single":
        x = torch.empty(4, device=device)
        dist.all_to_all_single(x, ar(4) + 10 * r)
        want = [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]][r]
    elif op == "send_recv":
        x = full(5, -1)
        if r == 0:
            dist.send(full(5, 42), 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(full(5, 42), 0)
        want = [42.0] * 5
    elif op == "batch_isend_irecv":
        x = full(6, -1)
        ops = [dist.P2POp(dist.isend, full(6, r + 5), peer), dist.P2POp(dist.irecv, x, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        want = [peer + 5.0] * 6
    elif op == "comm_all_reduce":
        x = full(4, r + 1)
        comm.all_reduce(x, g, async_op=True).wait()
        want = [3.0] * 4
    elif op == "comm_reduce_scatter_bucket":
        bucket = ar(4) + 10 * r
        x = bucket.narrow(0, 2 * r, 2)
        comm.reduce_scatter_bucket(x, bucket, g).wait()
        want = [[10.0, 12.0], [14.0, 16.0]][r]
    elif op == "comm_all_gather_bucket":
        x = torch.zeros(6, device=device)
        x.narrow(0, 3 * r, 3).fill_(r + 1)
        comm.all_gather_bucket(x, x.narrow(0, 3 * r, 3), g).wait()
        want = [1.0] * 3 + [2.0] * 3
    elif op == "comm_all_to_all":
        x = torch.empty(4, device=device)
        comm.all_to_all(x, ar(4) + 10 * r, g)
        want = [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]][r]
    elif op == "comm_broadcast":
        x = full(4, 10 * r + 7)
        comm.broadcast(x, 1, g)
        want = [17.0] * 4
    elif op == "comm_batch_p2p":
        x = full(6, -1)
        for w in comm.batch_p2p(g, sends=[(full(6, r + 5), peer)], recvs=[(x, peer)]):
            w.wait()
        want = [peer + 5.0] * 6
    else:
        raise ValueError(f"unknown probe {op!r}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    got = x.cpu().tolist()
    return got == want, got


def probe_child(spec: dict) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    r = int(os.environ["RANK"])
    log = Records(spec["records"], r, spec["attempt"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=spec["op_timeout_s"])
    dist.init_process_group(spec["backend"], init_method="env://", timeout=timeout)
    log(event="ready", backend=dist.get_backend())
    # the dry run's CPU tensors would not be staged: forced there, so the copies run
    staging = True if os.environ.get("MESHTRAIN_HOST_STAGING") == "1" else None
    for op in spec["jobs"]:
        log(job=op, event="enter")
        fault("MULTIRANK_FAULT", op, r)
        t0 = time.perf_counter()
        try:
            ok, got = _probe(op, r, device, staging)
            log(job=op, event="done", ok=ok, got=got, s=round(time.perf_counter() - t0, 3))
        except Exception as exc:  # noqa: BLE001 - the verdict is the record
            log(job=op, event="done", ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    log(event="exit")
    dist.destroy_process_group()


def _whole_model(engine) -> dict:
    """Every parameter of the unsplit model on every rank, on the CPU
    (``tests/layouts/ranks.py: whole_model`` over ``comm``, so gloo's CUDA tensors are
    staged): ZeRO-3 gathered, tp unsharded, ep slices gathered, pp stages merged."""
    import torch
    import torch.distributed as dist

    from meshtrain.distributed import comm
    from meshtrain.parallel.experts import is_expert_param
    from meshtrain.parallel.tensor.sharding import specs_by_param, unshard_tensor

    topo, module = engine.topology, engine.module
    mine = {}
    with engine.gathered_parameters():
        if engine.pipeline is None:
            params = dict(module.named_parameters())
        else:
            params = {n: p for s in module.stages.values() for n, p in s.names.items()}
        specs = specs_by_param(module)
        for name in sorted(params):
            p = params[name]
            t = p.detach()
            spec = specs.get(id(p))
            if spec is not None:
                t = unshard_tensor(t, spec, topo.tp_group)
            if is_expert_param(p) and topo.ep_size > 1:
                eg = topo.group("ep")
                t = t.contiguous()
                out = torch.empty(eg.size * t.numel(), dtype=t.dtype, device=t.device)
                comm.all_gather(out, t.view(-1), eg, label="state_dict")
                t = out.view(eg.size * t.shape[0], *t.shape[1:])
            mine[name] = t.cpu().clone()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict = {}
    for part in every:
        merged.update(part)
    return merged


def layouts_child(spec: dict) -> None:
    import gc

    import torch

    import meshtrain
    from meshtrain.distributed.env import init_distributed
    from meshtrain.distributed.topology import Topology

    r = int(os.environ["RANK"])
    log = Records(spec["records"], r, spec["attempt"])
    torch.set_num_threads(1)
    exact_fp32(torch)
    device = torch.device(spec["device"])
    init_distributed(timeout_minutes=spec["pg_timeout_min"], backend=spec["backend"])
    log(event="ready")
    meshes: dict = {}
    by_key = {f"{m} {lab}": (m, f) for m, lab, f in LAYOUTS}
    for key in spec["jobs"]:
        name, fields = by_key[key]
        log(job=key, event="enter")
        fault("MULTIRANK_FAULT", key, r)
        t0 = time.perf_counter()
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            mesh = (fields.get("pp", 1), fields.get("tp", 1), fields.get("cp", 1),
                    fields.get("ep", 1))  # fmt: skip
            if mesh not in meshes:  # one Topology per mesh: gloo keeps a group's threads
                pp, tp, cp, ep = mesh
                meshes[mesh] = Topology(pp=pp, tp=tp, cp=cp, ep=ep, device=device)
            model = build(name)
            engine, *_ = meshtrain.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=layout_config(name, fields),
                topology=meshes[mesh],
            )
            topo = engine.topology
            losses = [
                engine.train_batch(iter(micro_batches(s, topo.dp_size, topo.dp_rank))).item()
                for s in range(STEPS)
            ]
            state = _whole_model(engine)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            path = None
            if r == 0:
                path = os.path.join(spec["work"], key.replace(" ", "_") + ".pt")
                torch.save({"losses": losses, "state": state}, path)
            del engine, model, state
            gc.collect()
            log(job=key, event="done", ok=True, path=path, peak_gib=peak,
                s=round(time.perf_counter() - t0, 2))  # fmt: skip
        except Exception as exc:  # the verdict is the record, then re-raised
            tb = traceback.format_exc(limit=-4)
            log(job=key, event="done", ok=False, error=f"{type(exc).__name__}: {exc}"[:800],
                traceback=tb[-1500:])  # fmt: skip
            raise  # the peers may be inside a collective: start the group afresh
    log(event="exit")


# ------------------------------------------------------------------------ the parent


def _start(mode: str, spec: dict, work: Path, dry: bool) -> list:
    spec_path = work / f"{_tag(mode, spec)}.json"
    spec_path.write_text(json.dumps(spec))
    return start(["benchmarks.gpu.multirank", mode, str(spec_path)], work, _tag(mode, spec), dry)


def _tag(mode: str, spec: dict) -> str:
    return f"{mode}_{spec['backend']}_{spec['attempt']}"


def run_pairs(mode, base: dict, jobs, records: Path, work: Path, deadline: float, dry: bool,
              start_s: float, job_s: float, on_done=None, meanwhile=None,
              once: bool = False) -> dict:  # fmt: skip
    """Run ``jobs`` on 2-rank groups of ``mode``: a group that crashes or stops making
    progress (``start_s`` before its first record, ``job_s`` per job after) is killed,
    the job it was in recorded as crashed / hung, and a fresh group takes the jobs after
    it until ``deadline``. Returns ``{job: {"rank0": rec, "rank1": rec} or a failure}``;
    ``on_done(job, recs)`` is called as each job finishes on both ranks, ``meanwhile()``
    once while the first group starts. ``once``: no second group after a failure (the
    jobs left are recorded as not run)."""
    results: dict = {}
    remaining = list(jobs)
    stamp = time.time_ns() // 10**6 % 10**9  # attempts of another call share no name
    tries = 0
    while remaining and time.perf_counter() < deadline - 2:
        tries += 1
        attempt = f"{stamp}_{tries}"
        spec = {**base, "jobs": remaining, "attempt": attempt, "records": str(records)}
        procs = _start(mode, spec, work, dry)
        launched = time.perf_counter()
        if meanwhile is not None and tries == 1:
            meanwhile()
        last = time.perf_counter()
        seen = 0
        failure = None
        while True:
            time.sleep(0.1)
            recs = read_records(records, attempt)
            if len(recs) > seen:
                seen, last = len(recs), time.perf_counter()
            for job in remaining:
                if job in results:
                    continue
                done = {x["rank"]: x for x in recs if x.get("job") == job and x["event"] == "done"}
                if len(done) == 2:
                    results[job] = {f"rank{k}": v for k, v in sorted(done.items())}
                    if on_done is not None:
                        on_done(job, results[job])
                        last = time.perf_counter()  # the parent's own time is no hang
            rcs = [p.poll() for p, _ in procs]
            now = time.perf_counter()
            started = any(x["event"] == "ready" for x in recs)
            limit = job_s if started else start_s
            if all(rc is not None for rc in rcs):
                if any(rcs):
                    failure = f"a rank exited {rcs}"
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
        for job in remaining:  # records that came while stopping
            done = {
                x["rank"]: x
                for x in read_records(records, attempt)
                if x.get("job") == job and x["event"] == "done"
            }
            if job not in results and len(done) == 2:
                results[job] = {f"rank{k}": v for k, v in sorted(done.items())}
                if on_done is not None:
                    on_done(job, results[job])
        left = [j for j in remaining if j not in results]
        if left and failure is None:
            failure = "the group ended with jobs left"
        recs = read_records(records, attempt)
        current = left[0] if left else None
        entered = [x for x in recs if current is not None and x.get("job") == current]
        progressed = any("job" in x for x in recs)
        if left and failure is not None and not entered and progressed:
            pass  # it died between jobs (after a job that failed on both ranks): go on
        elif left and failure is not None:
            # the job it was in failed; a group that failed before its first job fails
            # every job left the same way (a start-up failure is no job's)
            for job in left[:1] if entered else left:
                half = {f"rank{x['rank']}": x for x in entered if x["event"] == "done"}
                results[job] = {
                    "failed": failure if entered else f"{failure} before the first job",
                    "exit": rcs,
                    "stderr": stderr_tail(work, _tag(mode, spec)),
                    "seconds": round(time.perf_counter() - launched, 1),
                    **half,
                }
                if on_done is not None:
                    on_done(job, results[job])
            left = left[1:] if entered else []
        remaining = left
        if failure is None:
            break
        if once and remaining:
            for job in remaining:
                results[job] = {"failed": f"not run: a job before it failed ({failure})"}
                if on_done is not None:
                    on_done(job, results[job])
            remaining = []
    for job in remaining:
        results.setdefault(job, {"failed": "skipped: the section's time ran out"})
    return results


def _verdict(result: dict) -> bool:
    return all(result.get(f"rank{k}", {}).get("ok") is True for k in (0, 1))


def probe(ctx, backend: str, out_dir: Path, work: Path, deadline: float) -> dict:
    gloo = backend == "gloo"
    ops = (*RAW_OPS, *(COMM_OPS if gloo else ()), *P2P_OPS)  # dangerous ones last
    base = {"backend": backend, "device": str(ctx.device), "op_timeout_s": PROBE_OP_S}
    res = run_pairs(
        "probe", base, ops, out_dir / f"probe_{backend}.jsonl", work, deadline, ctx.dry,
        PROBE_START_S, PROBE_OP_S,
    )  # fmt: skip
    table = {}
    for op in ops:
        r = res[op]
        if "failed" in r:
            table[op] = "FAILED: " + r["failed"] + (f" [{r['stderr']}]" if r.get("stderr") else "")
        elif _verdict(r):
            table[op] = "ok"
        else:
            why = [r[k].get("error") or f"got {r[k].get('got')}" for k in ("rank0", "rank1")]
            table[op] = "WRONG: " + "; ".join(str(w) for w in why)
    return table


def section(ctx) -> dict:
    torch = ctx.torch
    t0 = time.perf_counter()
    budget = float(getattr(ctx, "budget_s", 150.0))
    deadline = t0 + budget
    out_dir = ctx.out / "multirank"
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("*.jsonl"):
        f.unlink()
    work = Path(tempfile.mkdtemp(prefix="multirank-"))
    result: dict = {"bound": BOUND, "steps": STEPS, "device": str(ctx.device)}

    # (a) the probes: nccl (GPU only), then gloo, each within PROBE_S
    probes = {}
    if ctx.cuda:
        try:
            end = min(deadline, time.perf_counter() + PROBE_S)
            probes["nccl"] = probe(ctx, "nccl", out_dir, work, end)
        except Exception as exc:  # noqa: BLE001
            probes["nccl"] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        probes["nccl"] = {"skipped": "no CUDA (dry run): NCCL needs one"}
    try:
        end = min(deadline, time.perf_counter() + PROBE_S)
        probes["gloo"] = probe(ctx, "gloo", out_dir, work, end)
    except Exception as exc:  # noqa: BLE001
        probes["gloo"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["probe"] = probes
    result["probe_s"] = round(time.perf_counter() - t0, 1)
    for b in ("nccl", "gloo"):
        tab = probes[b]
        if "skipped" in tab or "error" in tab:
            result[f"{b}_ops_ok"] = None
        else:
            result[f"{b}_ops_ok"] = f"{sum(v == 'ok' for v in tab.values())}/{len(tab)}"
    nccl_good = ctx.cuda and all(probes["nccl"].get(op) == "ok" for op in NEEDED)
    backend = "nccl" if nccl_good else "gloo"
    result["layout_backend"] = backend
    result["layout_backend_why"] = (
        "nccl: every op the layouts use was correct on the shared GPU"
        if nccl_good
        else "gloo, CUDA tensors staged through host memory by comm"
        + ("" if ctx.cuda else " (dry run: CPU tensors over gloo, staged all the same)")
    )

    # (b) the layouts, on one group restarted after a failure, against this process
    jobs = [f"{m} {lab}" for m, lab, _ in LAYOUTS]
    rows: dict = {}
    refs: dict = {}
    records = out_dir / "layouts.jsonl"
    summary = out_dir / "layouts_compared.jsonl"

    current = {"backend": backend}

    def compared(job: str, recs: dict) -> None:
        name = job.split(" ")[0]
        row = {"layout": job, "backend": current["backend"]}
        if "failed" in recs:
            row.update(ok=False, error=recs["failed"], stderr=recs.get("stderr"))
        elif not _verdict(recs):
            bad = [recs[k] for k in ("rank0", "rank1") if not recs[k].get("ok")]
            row.update(ok=False, error=bad[0].get("error"), traceback=bad[0].get("traceback"))
        else:
            try:
                if name not in refs:
                    refs[name] = reference(name, ctx.device)
                if isinstance(refs[name], str):
                    raise RuntimeError(refs[name])
                got = torch.load(recs["rank0"]["path"], weights_only=True)
                row.update(compare((got["losses"], got["state"]), refs[name]))
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, error=f"compare: {type(exc).__name__}: {exc}")
            row["seconds"] = recs["rank0"].get("s")
            row["peak_gib"] = recs["rank0"].get("peak_gib")
        rows[job] = row
        with open(summary, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def references() -> None:  # while the group starts
        for name in dict.fromkeys(m for m, _, _ in LAYOUTS):
            try:
                refs[name] = reference(name, ctx.device)
            except Exception as exc:  # noqa: BLE001
                refs[name] = f"the reference failed: {type(exc).__name__}: {exc}"

    old = exact_fp32(torch)
    t_layouts = time.perf_counter()
    try:
        base = {
            "backend": backend,
            "device": str(ctx.device),
            "pg_timeout_min": 0.5,
            "work": str(work),
        }
        scale = 2.0 if ctx.dry else 1.0
        run_pairs(
            "layouts", base, jobs, records, work, deadline, ctx.dry,
            LAYOUT_START_S * scale, LAYOUT_S * scale, on_done=compared, meanwhile=references,
            once=backend == "nccl",  # after a failure gloo takes the rest (below)
        )  # fmt: skip
        again = [j for j in jobs if not rows.get(j, {}).get("ok")]
        if backend == "nccl" and again and deadline - time.perf_counter() > 20:
            # NCCL passed the probe but not these layouts: gloo (staged) tries them too
            first = {j: rows.pop(j, None) for j in again}
            current["backend"] = "gloo"
            run_pairs(
                "layouts", {**base, "backend": "gloo"}, again, records, work, deadline,
                ctx.dry, LAYOUT_START_S, LAYOUT_S, on_done=compared,
            )  # fmt: skip
            for j in again:
                rows.setdefault(j, {"layout": j, "ok": False})["nccl_try"] = first[j]
    except Exception as exc:  # noqa: BLE001
        result["layouts_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    result["layouts_s"] = round(time.perf_counter() - t_layouts, 1)
    result["layouts"] = [rows.get(j, {"layout": j, "ok": False, "error": "not run"}) for j in jobs]
    passed = [r for r in result["layouts"] if r.get("ok")]
    measured = [r for r in result["layouts"] if "model_rel" in r]
    result["layouts_passed"] = f"{len(passed)}/{len(jobs)}"
    result["layouts_run"] = len(measured)
    if measured:
        result["worst_loss_rel"] = max(r["max_loss_rel"] for r in measured)
        result["worst_model_rel"] = max(r["model_rel"] for r in measured)
    peaks = [r["peak_gib"] for r in measured if r.get("peak_gib") is not None]
    result["peak_gib"] = round(max(peaks), 3) if peaks else None
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["ok"] = len(passed) == len(jobs)
    shutil.rmtree(work, ignore_errors=True)  # what failed is quoted in the result
    return result


def _child_main(argv: list[str]) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives
    mode, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    {"probe": probe_child, "layouts": layouts_child}[mode](spec)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
