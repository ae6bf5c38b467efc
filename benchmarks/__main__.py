"""``python -m benchmarks``: every meshtrain role against its peers, in one invocation.

For each role of ``benchmarks.peers.ROLES`` (DP vs torch DDP and DeepSpeed ZeRO-0, ZeRO-1
vs ZeroRedundancyOptimizer and DeepSpeed Z1, ZeRO-2 vs FSDP2 without resharding and
DeepSpeed Z2, ZeRO-3 vs FSDP2 and DeepSpeed Z3; TP, PP, Trainer and Accelerator through
their own scripts' launchers, ``benchmarks.external``) it launches each framework in fresh
processes (``torch.distributed.run --standalone``, gloo, one thread per rank), interleaved
and in reversed order on odd repeats so background load hits all alike. It writes
``benchmarks/results/suite-<time>.json`` (every run, the machine load before it), a
markdown table and a PNG chart of samples/s and peak RSS per role, prints the scaling
efficiency of meshtrain data parallelism (samples/s at N ranks / (N x one rank at one
thread), same global batch, the 3.7M model), and ends with one line per pair::

    pair <role> vs <peer>: speed <r>x rss <r>x

(medians over repeats of the same-round ratio meshtrain/peer; rss is the larger rank's
peak RSS). DP/ZeRO runs also record CPU ms per step. ``--ledger-off-too`` runs each
meshtrain DP/ZeRO framework again right after itself with ``MESHTRAIN_LEDGER=0`` and
prints ``ledger <framework> on vs off: speed <r>x rss <r>x cpu <r>x``.

``--quick`` (3.7M model everywhere, 1 round, 6 steps) aims at < 5 minutes on an idle
2-core machine. The default (3 rounds) trains the 69.2M decoder in every decoder role (DP,
ZeRO, TP, PP: the model of issue 12's targets) for ``--steps`` (12), and takes at least 40
steps where a step is short (the 3.7M scaling runs, the Trainer, the Accelerator).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import peers

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SEED, SEQ_LEN = 1234, 32
ZERO = {
    "reduce_bucket_size": 10_000_000,
    "allgather_bucket_size": 10_000_000,
    "stage3_prefetch_bucket_size": 5_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


# Steps of a full-mode run whose steps are short (the 3.7M scaling runs, the Trainer, the
# Accelerator): at the default 12 such a run lasts about 1 s, and start-up jitter then swings
# one pair by 10-20% (the suite of 2026-11-23 16:53: the Accelerator read 0.83x and 0.99x).
SHORT_RUN_STEPS = 40


def _steps(args, short: bool) -> int:
    return max(args.steps, SHORT_RUN_STEPS) if short and not args.quick else args.steps


# ------------------------------------------------------------------------------- worker
def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from meshtrain.models import Decoder, DecoderConfig

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    micro = args.batch // world
    cfg = dict(peers.DECODERS[args.model], max_seq_len=64, seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, cfg["vocab_size"], (args.steps, args.batch, SEQ_LEN), generator=gen)
    shards = data[:, rank * micro : (rank + 1) * micro].contiguous()
    torch.manual_seed(SEED)
    model = Decoder(DecoderConfig(**cfg))
    n_params = sum(p.numel() for p in model.parameters())
    run = peers.setup(args.worker, model, micro=micro, world=world, zero=ZERO)
    del model
    if not dist.is_initialized():
        raise SystemExit("no process group")
    dist.barrier()
    ends, cpu, losses = [], [], []
    for i in range(args.steps):
        loss = run.forward(shards[i])
        run.backward(loss)
        run.step()
        losses.append(float(loss))
        ends.append(time.perf_counter())
        cpu.append(time.process_time())  # this process, every thread (gloo's too)
    elapsed = torch.tensor([ends[-1] - ends[0]], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's clock
    cpu_s = torch.tensor([cpu[-1] - cpu[0]], dtype=torch.float64)
    dist.all_reduce(cpu_s)  # summed over ranks
    peak = [None] * world
    dist.all_gather_object(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    if rank == 0:
        timed = args.steps - 1
        out = {
            "framework": args.worker,
            "world": world,
            "n_params": n_params,
            "samples_per_s": timed * args.batch / float(elapsed),
            "steps_per_s": timed / float(elapsed),
            "peak_rss_mib": max(peak),
            "peak_rss_mib_per_rank": peak,
            "cpu_ms_per_step": 1000 * float(cpu_s) / world / timed,  # per rank
            "losses": (loss_t / world).tolist(),
        }
        Path(args.result).write_text(json.dumps(out))
    run.shutdown()


# ------------------------------------------------------------------------------- driver
NOLEDGER = "@noledger"  # a framework name's suffix: the same run with MESHTRAIN_LEDGER=0


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "src"), str(REPO), env.get("PYTHONPATH")])
    )
    return env


def _external(name: str, nproc: int, steps: int, quick: bool, tmp: str) -> dict:
    from benchmarks.external import RUNNERS

    load = os.getloadavg()[0]
    try:
        out = RUNNERS[name](nproc, steps, quick, tmp)
    except Exception as exc:  # noqa: BLE001 - one failed framework must not end the suite
        out = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    if out is None:
        out = {"error": "no result"}
    out.update(framework=name, load1_before=round(load, 2))
    return out


def _launch(name: str, nproc: int, model: str, steps: int, batch: int, tmp: str) -> dict:
    result = os.path.join(tmp, f"{name}-{nproc}-{time.monotonic_ns()}.json")
    env = _env()
    if name.endswith(NOLEDGER):
        env["MESHTRAIN_LEDGER"] = "0"
        name = name[: -len(NOLEDGER)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(nproc), "-m", "benchmarks", "--worker", name, "--result", result,
        "--model", model, "--steps", str(steps), "--batch", str(batch),
    ]  # fmt: skip
    load = os.getloadavg()[0]
    for attempt in (1, 2):  # judged by the result file; a run without one is retried once
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if os.path.exists(result):
            out = json.loads(Path(result).read_text())
            out.update(load1_before=round(load, 2), rc=proc.returncode, attempt=attempt)
            return out
    return {"framework": name, "error": (proc.stdout + proc.stderr)[-2000:], "load1_before": load}


def _scaling(args, tmp: str) -> dict | None:
    """Scaling efficiency of meshtrain data parallelism: samples/s of ``mt-z0`` at N ranks /
    (N x one rank at one thread), the 3.7M model, the same global batch of 16. Each round
    runs both (the order alternating); the efficiency is the median of the rounds'."""
    steps, n = _steps(args, short=True), args.nproc
    rounds = []
    for rep in range(args.repeats):
        runs = {k: _launch("mt-z0", k, "small", steps, 16, tmp) for k in ((1, n), (n, 1))[rep % 2]}
        if any("error" in r for r in runs.values()):
            continue
        one, many = runs[1]["samples_per_s"], runs[n]["samples_per_s"]
        rounds.append({"one_rank_samples_per_s": one, "n_rank_samples_per_s": many,
                       "efficiency": many / (n * one),
                       "load1_before": max(r["load1_before"] for r in runs.values())})  # fmt: skip
    if not rounds:
        return None
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {**med, "n": n, "rounds": rounds}


def _chart(summary: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, label in (
        (axes[0], "samples_per_s", "samples/s"),
        (axes[1], "peak_rss_mib", "peak RSS / rank (MiB)"),
    ):
        names, vals, colors = [], [], []
        for role, (mine, others) in peers.ROLES.items():
            for fw in (mine, *others):
                if fw in summary:
                    names.append(f"{role}\n{fw}")
                    vals.append(summary[fw][key])
                    colors.append("tab:blue" if fw == mine else "tab:gray")
        ax.bar(range(len(vals)), vals, color=colors)
        ax.set_xticks(range(len(vals)), names, rotation=60, fontsize=7)
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _pair(mine: list[dict], peer: list[dict], cpu: bool = False) -> tuple | None:
    """Median over rounds of the same-round ratios mine/peer: (samples/s, peak RSS), and
    with ``cpu`` the ratio of CPU ms per step (None where a run has none)."""
    by_round = {r["round"]: r for r in mine if "error" not in r}
    speed, rss, cpu_ms = [], [], []
    for r in peer:
        m = by_round.get(r["round"])
        if m is not None and "error" not in r:
            speed.append(m["samples_per_s"] / r["samples_per_s"])
            rss.append(m["peak_rss_mib"] / r["peak_rss_mib"])
            if "cpu_ms_per_step" in m and "cpu_ms_per_step" in r:
                cpu_ms.append(m["cpu_ms_per_step"] / r["cpu_ms_per_step"])
    if not speed:
        return None
    out = (statistics.median(speed), statistics.median(rss))
    return (*out, statistics.median(cpu_ms) if cpu_ms else None) if cpu else out


def driver(args) -> int:
    from benchmarks.external import DECODER, RUNNERS

    RESULTS.mkdir(parents=True, exist_ok=True)
    os.environ.update(_env())  # the standalone scripts' launchers inherit it
    t_start = time.monotonic()
    roles = [r for r in peers.ROLES if not args.roles or r in args.roles.split(",")]
    names = []
    for r in roles:
        mine, others = peers.ROLES[r]
        names += [n for n in (mine, *others) if n not in names]
    if args.no_deepspeed:
        names = [n for n in names if not n.startswith("ds-")]
    if args.no_peers:
        names = [n for n in names if n in peers.MESHTRAIN or n.startswith("mt-")]
    ledger = []  # meshtrain frameworks measured with the ledger off as well, right after
    if args.ledger_off_too:
        ledger = [n for n in names if n in peers.MESHTRAIN]
        names = [m for n in names for m in ((n, n + NOLEDGER) if n in ledger else (n,))]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = names if rep % 2 == 0 else names[::-1]
            for n in order:
                model = "small" if args.quick else "large"
                batch = 16 if model == "small" else 8
                steps = _steps(args, short=n in RUNNERS and n not in DECODER)
                if n in RUNNERS:
                    r = _external(n, args.nproc, steps, args.quick, tmp)
                else:
                    r = _launch(n, args.nproc, model, steps, batch, tmp)
                r["round"] = rep
                runs[n].append(r)
                ok = "error" not in r
                print(
                    f"  [{rep}] {n:12s} "
                    + (
                        f"{r['samples_per_s']:7.1f} samples/s  {r['peak_rss_mib']:6.0f} MiB"
                        + (
                            f"  {r['cpu_ms_per_step']:6.1f} CPU ms/step"
                            if "cpu_ms_per_step" in r
                            else ""
                        )
                        if ok
                        else "FAILED"
                    )
                    + f"  (load {r['load1_before']:.1f})",
                    flush=True,
                )
        scaling = None
        if "mt-z0" in names and not args.no_scaling:
            scaling = _scaling(args, tmp)

    summary = {}
    for n, rs in runs.items():
        good = [r for r in rs if "error" not in r]
        if good:
            summary[n] = {
                "samples_per_s": statistics.median(r["samples_per_s"] for r in good),
                "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in good),
                "n_params": good[0].get("n_params"),
                "load1": [r["load1_before"] for r in good],
            }
            if all("cpu_ms_per_step" in r for r in good):
                summary[n]["cpu_ms_per_step"] = statistics.median(
                    r["cpu_ms_per_step"] for r in good
                )
    pairs = []
    for role in roles:
        mine, others = peers.ROLES[role]
        for peer in others:
            ratio = _pair(runs[mine], runs[peer]) if peer in runs else None
            if ratio is not None:
                pairs.append((role, mine, peer, *ratio))
    ledger_pairs = []  # ledger on / ledger off, same round
    for n in ledger:
        ratio = _pair(runs[n], runs[n + NOLEDGER], cpu=True)
        if ratio is not None:
            ledger_pairs.append((n, *ratio))

    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M")
    base = RESULTS / f"suite-{stamp}-np{args.nproc}{'-quick' if args.quick else ''}"
    lines = [
        "| role | framework | params | samples/s | CPU ms/step | peak RSS MiB | speed vs peer "
        "| RSS vs peer | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for role in roles:
        mine, others = peers.ROLES[role]
        for fw in (mine, *others, *([mine + NOLEDGER] if mine in ledger else [])):
            if fw not in summary:
                continue
            s = summary[fw]
            pr = next((p for p in pairs if p[2] == fw and p[0] == role), None)
            params = f"{s['n_params'] / 1e6:.1f}M" if s["n_params"] else "(script's)"
            cpu = f"{s['cpu_ms_per_step']:.1f}" if "cpu_ms_per_step" in s else ""
            lines.append(
                f"| {role} | {fw} | {params} | {s['samples_per_s']:.2f} | {cpu} | "
                f"{s['peak_rss_mib']:.0f} | {f'{pr[3]:.2f}x' if pr else ''} | "
                f"{f'{pr[4]:.2f}x' if pr else ''} | {', '.join(f'{x:.1f}' for x in s['load1'])} |"
            )
    if scaling:
        lines.append(
            f"\nScaling efficiency (mt-z0, 3.7M model): {scaling['efficiency']:.2f} "
            f"({scaling['n_rank_samples_per_s']:.1f} samples/s at N={scaling['n']} vs "
            f"{scaling['one_rank_samples_per_s']:.1f} at 1 rank; median of {len(scaling['rounds'])} "
            f"paired rounds, load up to {scaling['load1_before']:.1f})"
        )
    cpu_children = sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])
    wall = time.monotonic() - t_start
    lines.append(
        f"\nSuite: {wall:.0f} s wall, {cpu_children:.0f} s CPU in all its processes "
        f"(on an idle 2-core machine about {cpu_children / 2:.0f} s); load at the end "
        f"{os.getloadavg()[0]:.1f}"
    )
    table = "\n".join(lines)
    Path(f"{base}.md").write_text(table + "\n")
    charted = _chart(summary, Path(f"{base}.png"))
    Path(f"{base}.json").write_text(json.dumps(
        {"args": vars(args), "machine_load_end": os.getloadavg(), "runs": runs, "summary": summary,
         "pairs": pairs, "ledger_pairs": ledger_pairs, "scaling": scaling,
         "wall_s": wall, "cpu_s": cpu_children}, indent=1))  # fmt: skip
    print("\n" + table)
    print(f"\nwrote {base}.json, {base}.md" + (f", {base}.png" if charted else ""))
    if scaling:
        print(f"scaling efficiency N={scaling['n']}: {scaling['efficiency']:.2f}")
    for fw, sp, rs, cpu in ledger_pairs:
        cpu_text = "" if cpu is None else f" cpu {cpu:.2f}x"
        print(f"ledger {fw} on vs off: speed {sp:.2f}x rss {rs:.2f}x{cpu_text}")
    for role, _mine, peer, sp, rs in pairs:
        print(f"pair {role} vs {peer}: speed {sp:.2f}x rss {rs:.2f}x")
    return 0 if pairs or ledger_pairs else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3.7M model, 1 round, 6 steps")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=None, help="rounds (default: 1 with --quick, else 3)"
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--roles", default="", help="comma-separated subset of " + ",".join(peers.ROLES)
    )
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--no-peers", action="store_true", help="run meshtrain's frameworks only")
    ap.add_argument(
        "--ledger-off-too",
        action="store_true",
        help="also run each meshtrain DP/ZeRO framework with MESHTRAIN_LEDGER=0, in the same "
        "rounds, and print the ratios ledger on / off",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="small", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 6 if args.quick else 12
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
