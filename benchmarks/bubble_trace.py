"""Where a pipeline step's excess bubble goes: every action of every rank, timed.

A debug companion of ``bench_pipeline_bubble.py`` (same sleep-cost stages, same
``PipelineRuntime``): each rank records its compute actions (``runtime.trace``) and the
wall time, CPU time and run-queue wait (``/proc/thread-self/schedstat``: time runnable but
not running, i.e. waiting for a core) of every p2p call (``StepLinks``' sends, receive
posts and waits), and of the loss broadcast. For every compute it prints the *delay*:

    delay = start - max(end of this rank's previous compute, end of the compute on
                        another rank whose data it consumes)

i.e. the time by which it started later than an as-soon-as-possible run would start it
given what really happened before it, and which actions filled that gap. The delays
summed along the ranks are the bubble in excess of the schedule's own; by action they
say whether a rank waited on a receive it did not need, paid for its sends, or waited
for a core.

    python benchmarks/bubble_trace.py interleaved_1f1b --pp 2 --m 8 --v 2 [--unit-ms 100]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from meshtrain.launch.processes import run_on_ranks

try:  # run as a script from the repository root or as benchmarks.bubble_trace
    from bench_pipeline_bubble import sleep_pipeline, step_idle
except ImportError:  # pragma: no cover
    from benchmarks.bench_pipeline_bubble import sleep_pipeline, step_idle

TIMED = ("post_ahead", "activation", "gradient", "send_activation", "send_gradient")


def _runqueue() -> float:
    with open("/proc/thread-self/schedstat") as fh:
        return int(fh.read().split()[1]) / 1e9


def _rank(unit: float, schedule: str, v: int, m: int, steps: int):
    import torch.distributed as dist

    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.pipeline import p2p, runtime

    torch.set_num_threads(1)
    events: list[tuple] = []  # (name, start, end, cpu s, run-queue s)

    def timed(fn, name):
        def call(*args, **kwargs):
            t0, c0, q0 = time.perf_counter(), time.thread_time(), _runqueue()
            out = fn(*args, **kwargs)
            dt_q, dt_c = _runqueue() - q0, time.thread_time() - c0
            events.append((name, t0, time.perf_counter(), dt_c, dt_q))
            return out

        return call

    # patched in this rank's process only (a debug tool; the runtime has no hooks for it)
    for name in TIMED:
        if hasattr(p2p.StepLinks, name):
            setattr(p2p.StepLinks, name, timed(getattr(p2p.StepLinks, name), name))
    runtime.comm.broadcast = timed(runtime.comm.broadcast, "loss_broadcast")
    p2p.StepLinks.finish = timed(p2p.StepLinks.finish, "finish")

    topo = Topology(pp=dist.get_world_size())
    pm, rt = sleep_pipeline(topo, schedule, v, unit)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))] * m
    out = []
    for step in range(steps + 1):  # the first step is a warm-up
        dist.barrier()
        rt.trace, events[:] = [], []
        t0 = time.perf_counter()
        rt.train_step(batches)
        t1 = time.perf_counter()
        if step:
            computes = [(k, s, mb, a, b) for k, s, mb, a, b, _c in rt.trace]
            out.append({"t0": t0, "t1": t1, "computes": computes, "events": list(events)})
        for prm in pm.parameters():
            prm.grad = None
    return out


def delays(steps_per_rank: list[dict], last: int):
    """Per compute of one step: ``(rank, action, start, delay, events in the gap)``."""
    from meshtrain.parallel.pipeline.schedules import Action, _deps

    end, rank_of = {}, {}
    for r, st in enumerate(steps_per_rank):
        for k, s, mb, _a, b in st["computes"]:
            end[Action(s, k, mb)], rank_of[Action(s, k, mb)] = b, r
    rows = []
    for r, st in enumerate(steps_per_rank):
        prev = st["t0"]
        for k, s, mb, a, b in sorted(st["computes"], key=lambda x: x[3]):
            act = Action(s, k, mb)
            deps = _deps(act, last)
            if k == "W" and s == 0:  # ZB-H1 stage 0: B is a no-op, W consumes the gradient
                deps = [Action(1, "B", mb)]
            dep = [end[d] for d in deps if d in end and rank_of[d] != r]
            ready = max([prev, *dep])
            gap = [e for e in st["events"] if e[2] > ready and e[1] < a]
            rows.append((r, act, a, a - ready, gap))
            prev = b
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("schedule")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--v", type=int, default=1)
    ap.add_argument("--unit-ms", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--show-ms", type=float, default=2.0, help="list computes delayed more")
    args = ap.parse_args(argv)
    per_rank = run_on_ranks(
        _rank, args.pp, (args.unit_ms / 1000, args.schedule, args.v, args.m, args.steps)
    )
    last = args.pp * args.v - 1
    for k in range(args.steps):
        steps = [r[k] for r in per_rank]
        windows = [
            [(st["t0"], st["t1"], sum(b - a for *_x, a, b in st["computes"]))] for st in steps
        ]
        idle, own = step_idle(windows)
        t0 = min(st["t0"] for st in steps)
        makespan = max(st["t1"] for st in steps) - t0
        rows = delays(steps, last)
        by_action: collections.Counter = collections.Counter()
        for _r, _act, _a, _d, gap in rows:
            for name, x, y, _cpu, _q in gap:
                by_action[name] += y - x
        total = sum(d for *_x, d, _g in rows)
        print(
            f"step {k + 1}: makespan {1e3 * makespan:.1f} ms, idle {idle:.4f} (per-rank "
            f"windows {own:.4f}); compute delays {1e3 * total:.1f} ms in all; gaps hold "
            + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in by_action.most_common())
        )
        for r, st in enumerate(steps):
            busy = sum(b - a for *_x, a, b in st["computes"])
            last_end = max(b for *_x, _a, b in st["computes"])
            print(
                f"  rank {r}: step {1e3 * (st['t0'] - t0):.1f} to {1e3 * (st['t1'] - t0):.1f} ms "
                f"(last compute ends {1e3 * (last_end - t0):.1f}), busy {1e3 * busy:.1f} ms"
            )
        for r, act, a, d, gap in rows:
            if d * 1e3 >= args.show_ms:
                what = "; ".join(
                    f"{n} {1e3 * (y - x):.1f} ms (cpu {1e3 * c:.2f}, run-queue {1e3 * q:.2f})"
                    for n, x, y, c, q in gap
                )
                print(f"  rank {r} {act} at {1e3 * (a - t0):.1f} ms: +{1e3 * d:.1f} ms: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
