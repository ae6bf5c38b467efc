"""Pipeline parallelism: measured bubble vs the formula, and meshtrain vs torch pipelining.

Two parts, each rank a real process on gloo with one thread (``run_on_ranks``):

1. **Bubble.** A model of equal-cost stages (``PipelineModule`` of ``Linear(D, D) + tanh``
   layers, the same count per stage) runs GPipe and 1F1B at pp 2 for several micro-batch
   counts. Each rank records the wall time of its compute actions (``runtime.trace``);
   idle = 1 - busy summed over the ranks / (p x the step's makespan, first rank's start
   to last rank's end), median over steps (``bench_pipeline_bubble.step_idle``). Printed beside
   ``(p - 1) / (m + p - 1)``; communication counts as idle, so measured >= formula. On a
   shared machine other jobs stretch single ops unevenly, so the schedule is also replayed
   with each op's median *CPU* time (``thread_time``) as its cost.
2. **Peers.** The PEERS.md decoder (4 layers, d 256, vocab 1024; ``--model large``: the
   69.2M decoder of ``python -m benchmarks``, 8 layers, d 768, vocab 8192), seq 32, global
   batch 16 in 4 micro-batches of 4, AdamW, fp32, its layers split in half over pp 2:
   meshtrain (``engine.train_batch`` with the same split) against
   ``torch.distributed.pipelining`` ``ScheduleGPipe`` / ``Schedule1F1B`` on hand-written
   stage modules; zbv / dualpipev cut it into ``2 pp`` stages (a layer each for the
   PEERS.md decoder at pp 2), rank ``r`` holding stages ``r`` and ``2pp-1-r``, against
   ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` on the same cut (``--schedules``). samples/s (rank clocks, first 2 steps untimed, slowest rank) and peak
   RSS (VmHWM, largest rank); the peers run interleaved, ``--repeats`` rounds, medians.
   Losses are compared too. ``--adam-fused`` gives meshtrain's AdamW ``fused: true``
   (about 3x faster on CPU, ~1 ulp off torch's AdamW); the default steps each stage's
   flat parameters slice by slice, bit-identical to torch's.

    python benchmarks/bench_pipeline.py [--repeats 3] [--steps 20] [--model large]
    python benchmarks/bench_pipeline.py --parts peers --schedules zbv,dualpipev

Results go to ``benchmarks/results/pipeline-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from meshtrain.launch.processes import run_on_ranks
from meshtrain.parallel.pipeline.schedules import build_schedule

try:  # run as a script from the repository root or as benchmarks.bench_pipeline
    from bench_pipeline_bubble import step_idle
    from peers import ADAMW, DECODERS, add_model_argument
except ImportError:  # pragma: no cover
    from benchmarks.bench_pipeline_bubble import step_idle
    from benchmarks.peers import ADAMW, DECODERS, add_model_argument

RESULTS = Path(__file__).parent / "results"


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---- part 1: bubble ----------------------------------------------------------------------
class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _bubble_rank(schedule: str, m: int, steps: int, d: int, rows: int, per_stage: int):
    import torch.distributed as dist

    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.pipeline.runtime import PipelineRuntime
    from meshtrain.pipe import LayerSpec, PipelineModule

    topo = Topology(pp=dist.get_world_size())
    p = topo.pp_size
    pm = PipelineModule(
        [LayerSpec(Layer, d) for _ in range(per_stage * p)],
        topology=topo,
        loss_fn=lambda out, y: (out - y).pow(2).mean(),
        partition_method="uniform",
    )
    rt = PipelineRuntime(pm.stages, topo.pp_group, p, schedule)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g))] * m
    windows, cpu = [], {"F": [], "B": []}  # per timed step: (start, end, busy) seconds
    for step in range(steps + 2):
        dist.barrier()
        rt.trace = []
        t0 = time.perf_counter()  # system-wide monotonic clock: the ranks' times compare
        rt.train_step(batches)
        t1 = time.perf_counter()
        busy = sum(e - s for _k, _st, _mb, s, e, _c in rt.trace)
        if step >= 2:
            windows.append((t0, t1, busy))
            for kind, _st, _mb, _s, _e, c in rt.trace:
                cpu[kind].append(c)
        for prm in pm.parameters():
            prm.grad = None
    return windows, {k: statistics.median(v) for k, v in cpu.items()}


def bubble(args) -> list[dict]:
    out = []
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8):
            per_rank = run_on_ranks(
                _bubble_rank, args.pp, (schedule, m, args.steps, 512, 64, 4), timeout=600
            )
            measured, _ = step_idle([r[0] for r in per_rank])
            formula = (args.pp - 1) / (m + args.pp - 1)
            # the schedule replayed with each op's measured CPU time (immune to other
            # jobs taking the cores; communication excluded)
            costs = {k: statistics.mean(r[1][k] for r in per_rank) for k in ("F", "B")}
            s = build_schedule(schedule, args.pp, m, costs=costs)
            busy = sum(s.costs[a.kind] for a in s.start)
            replay = 1 - busy / (args.pp * s.makespan)
            row = {
                "schedule": schedule,
                "p": args.pp,
                "m": m,
                "measured_idle": measured,
                "replayed_idle": replay,
                "formula_idle": formula,
                "ratio": measured / formula,
                "cpu_costs_s": costs,
            }
            print(
                f"bubble {schedule:6} p={args.pp} m={m}: measured {measured:.3f} "
                f"({measured / formula:.2f}x), replayed with measured op costs {replay:.3f} "
                f"({replay / formula:.2f}x), formula {formula:.3f}",
                flush=True,
            )
            out.append(row)
    return out


# ---- part 2: peers -----------------------------------------------------------------------
MICRO, ROWS, SEQ = 4, 4, 32


def _decoder(model: str):
    from meshtrain.models import Decoder, DecoderConfig

    return Decoder(DecoderConfig(**DECODERS[model], max_seq_len=SEQ, seed=1234))


def _data(step: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (MICRO * ROWS, SEQ), generator=g)
    return [(ids[i * ROWS : (i + 1) * ROWS], ids[i * ROWS : (i + 1) * ROWS]) for i in range(MICRO)]


def _peer_rank(peer: str, steps: int, adam_fused: bool = False, model_name: str = "small"):
    import torch.distributed as dist

    import meshtrain
    from meshtrain.models.decoder import causal_lm_loss

    rank = dist.get_rank()
    model = _decoder(model_name)
    n_params = sum(p.numel() for p in model.parameters())  # the whole model's
    vocab = DECODERS[model_name]["vocab_size"]
    times, losses = [], []
    if peer.startswith("meshtrain"):
        config = {
            "train_micro_batch_size_per_gpu": ROWS,
            "gradient_accumulation_steps": MICRO,
            "optimizer": {
                "type": "AdamW",
                "params": {**ADAMW, "betas": list(ADAMW["betas"]), "fused": adam_fused},
            },
            "steps_per_print": 100000,
            "mesh": {"pipeline_parallel_size": dist.get_world_size()},
            "pipeline": {
                "schedule": peer.split("-")[1],
                "virtual_stages": 2 if peer.split("-")[1] in ("zbv", "dualpipev") else 1,
                "partition_method": "uniform",
            },
        }
        engine, *_ = meshtrain.initialize(model=model, config=config)
        for step in range(steps + 2):
            t0 = time.perf_counter()
            loss = engine.train_batch(iter(_data(step, vocab)))
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    else:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as tsched

        kind, p = peer.split("-")[1], dist.get_world_size()
        v_shaped = kind in ("zbv", "dualpipev")
        n_stages = 2 * p if v_shaped else p
        per = DECODERS[model_name]["n_layers"] // n_stages

        class Part(nn.Module):
            """Stage ``k`` of ``n_stages``: the embedding on the first, ``per`` layers, the
            norm and head on the last (meshtrain's uniform cut of the same model)."""

            def __init__(self, m, k):
                super().__init__()
                self.first, self.last = k == 0, k == n_stages - 1
                self.embed = m.embed if self.first else None
                self.layers = nn.ModuleList(m.layers[k * per : (k + 1) * per])
                self.norm = m.norm if self.last else None
                self.lm_head = m.lm_head if self.last else None
                self.register_buffer("cos", m.rope_cos, persistent=False)
                self.register_buffer("sin", m.rope_sin, persistent=False)

            def forward(self, x):
                if self.first:
                    x = self.embed(x)
                t = x.shape[1]
                for layer in self.layers:
                    x = layer(x, self.cos[:t], self.sin[:t])
                return self.lm_head(self.norm(x)) if self.last else x

        mine = [rank, n_stages - 1 - rank] if v_shaped else [rank]
        mods = [Part(model, k) for k in mine]
        del model
        cpu = torch.device("cpu")
        stages = [PipelineStage(md, k, n_stages, cpu) for md, k in zip(mods, mine, strict=True)]
        cls = {
            "gpipe": tsched.ScheduleGPipe,
            "1f1b": tsched.Schedule1F1B,
            "zbv": tsched.ScheduleZBVZeroBubble,
            "dualpipev": tsched.ScheduleDualPipeV,
        }[kind]
        sched = cls(stages if v_shaped else stages[0], n_microbatches=MICRO, loss_fn=causal_lm_loss)
        opt = torch.optim.AdamW([q for md in mods for q in md.parameters()], **ADAMW)
        first_rank, last_rank = 0, 0 if v_shaped else p - 1
        for step in range(steps + 2):
            data = _data(step, vocab)
            ids = torch.cat([x for x, _ in data])
            t0 = time.perf_counter()
            opt.zero_grad()
            out = []
            args = (ids,) if rank == first_rank else ()
            if rank == last_rank:
                sched.step(*args, target=ids, losses=out)
            else:
                sched.step(*args)
            opt.step()
            times.append(time.perf_counter() - t0)
            loss = torch.stack(out).detach().mean() if out else torch.zeros(())
            dist.broadcast(loss, src=last_rank)
            losses.append(float(loss))
    return {
        "seconds": sum(times[2:]),
        "losses": losses,
        "rss_mib": _vm_hwm_mib(),
        "n_params": n_params,
    }


KINDS = ("gpipe", "1f1b", "zbv", "dualpipev")


def peers(args) -> dict:
    kinds = [k for k in KINDS if k in args.schedules.split(",")]
    order = [f"{who}-{k}" for k in kinds for who in ("meshtrain", "torch")]
    runs: dict[str, list] = {p: [] for p in order}
    for _ in range(args.repeats):
        for peer in order:
            per_rank = run_on_ranks(
                _peer_rank, args.pp, (peer, args.steps, args.adam_fused, args.model), timeout=600
            )
            sec = max(r["seconds"] for r in per_rank)
            runs[peer].append(
                {
                    "samples_per_s": args.steps * MICRO * ROWS / sec,
                    "rss_mib": max(r["rss_mib"] for r in per_rank),
                    "losses": per_rank[0]["losses"],
                }
            )
    summary = {}
    for peer, rs in runs.items():
        summary[peer] = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "rss_mib": statistics.median(r["rss_mib"] for r in rs),
        }
    for kind in kinds:
        ours, theirs = summary[f"meshtrain-{kind}"], summary[f"torch-{kind}"]
        dl = max(
            abs(a - b)
            for a, b in zip(
                runs[f"meshtrain-{kind}"][0]["losses"],
                runs[f"torch-{kind}"][0]["losses"],
                strict=True,
            )
        )
        summary[f"ratio-{kind}"] = {
            "samples_per_s": ours["samples_per_s"] / theirs["samples_per_s"],
            "rss": ours["rss_mib"] / theirs["rss_mib"],
            "max_loss_diff": dl,
        }
        print(
            f"{kind:9} meshtrain {ours['samples_per_s']:.1f} samples/s {ours['rss_mib']:.0f} MiB"
            f" | torch {theirs['samples_per_s']:.1f} samples/s {theirs['rss_mib']:.0f} MiB"
            f" | ratio speed {summary[f'ratio-{kind}']['samples_per_s']:.2f}x"
            f" rss {summary[f'ratio-{kind}']['rss']:.2f}x | max loss diff {dl:.2e}",
            flush=True,
        )
    return {"runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="bubble,peers")
    ap.add_argument(
        "--schedules",
        default=",".join(KINDS),
        help="the peers part's schedules, against torch's ScheduleGPipe, Schedule1F1B, "
        "ScheduleZBVZeroBubble, ScheduleDualPipeV (zbv and dualpipev: 2 stages per rank in a V)",
    )
    add_model_argument(ap)  # the peers' decoder
    ap.add_argument(
        "--adam-fused",
        action="store_true",
        help="meshtrain's AdamW with fused: true (about 3x faster on CPU; rounds ~1 ulp "
        "differently from torch's default AdamW)",
    )
    args = ap.parse_args(argv)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load": os.getloadavg(),
        },
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "args": vars(args),
    }
    if "bubble" in args.parts:
        result["bubble"] = bubble(args)
    if "peers" in args.parts:
        result["peers"] = peers(args)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"pipeline-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
