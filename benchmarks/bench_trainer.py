"""meshtrain's Trainer vs transformers' Trainer on the same script, and the Trainer's step
overhead vs a hand-written engine loop.

Issue 15's benchmark. Workload: a BERT sequence classifier (hidden 128, 2 layers, 2
heads, ffn 256, vocab 4000; dropout off), fp32, 512 rows of 64 tokens (no padding, so
both Trainers run the same shapes), ``per_device_train_batch_size`` 16, AdamW lr 1e-3,
``--steps`` optimizer steps, logging every 1000 steps, no evaluation, no saving. Peers,
each in its own processes (torchrun's environment; one thread per rank):

* ``meshtrain``: ``meshtrain.Trainer`` (ZeRO stage 0);
* ``transformers``: ``transformers.Trainer`` (DDP over gloo when N > 1);
* ``engine-loop``: ``meshtrain.initialize`` + ``engine(batch)`` / ``backward`` / ``step``
  by hand on the same loader, collator, config, weight-decay groups and linear schedule:
  what the Trainer's loop adds on top.

samples/s counts steps after the first ``--warmup`` (a callback timestamps every
``on_step_end``; the hand loop timestamps its steps the same way), on rank 0. Each stamp
also records the process's CPU time (``time.process_time``, one thread): on a shared,
loaded machine wall time mostly measures the other jobs, while CPU seconds per step are
what the Trainer itself costs, so the Trainer's overhead is reported both ways
(``overhead_cpu`` is the one to trust when the load average exceeds the core count).
Peers are interleaved over ``--repeats`` rounds (in reversed order on odd rounds) and
the median is reported.

``--paired``: the Trainer's overhead measured inside one process, which a loaded machine
cannot blur. While ``Trainer.train()`` runs, a callback at every ``on_step_end`` runs one
hand-written step (``engine(batch)`` / ``backward`` / ``step`` on its own loader) on the
same engine, so Trainer steps and hand steps alternate on one model, one allocator and
one interpreter; each step's CPU time is taken, and the overhead is the median of the
per-pair differences over the median hand step. Separate processes differ by more than
the Trainer's cost: on the 2 shared cores one process's step CPU time varies by 10-20%
from run to run (cache and memory contention), so ``overhead_cpu`` over 5-6 processes
per peer has read from -4% to +10% on the same code. On this workload the paired figure
still moves by about +-1 ms per run under a load of 12-20; ``--tiny`` (hidden 16, one
layer, 8 tokens, 4 rows: a ~6 ms step) makes the Trainer's fixed per-step cost, in
microseconds, stand out of that noise.
Results: ``benchmarks/results/trainer-<date>-np<N>.json``
(``trainer-paired-<date>.json``).

    python benchmarks/bench_trainer.py --nproc 1 --nproc 2 [--steps 40] [--repeats 3]
    python benchmarks/bench_trainer.py --nproc 1 --peer meshtrain --peer engine-loop
    python benchmarks/bench_trainer.py --paired [--tiny] [--steps 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, LAYERS, VOCAB, SEQ, ROWS, BATCH = 128, 2, 4000, 64, 512, 16


def _data():
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (ROWS, SEQ), generator=g)
    labels = (ids[:, 0] % 2).tolist()
    return [
        {
            "input_ids": ids[i],
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "labels": labels[i],
        }
        for i in range(ROWS)
    ]


def _model():
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
        intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def _args(cls, out: str, steps: int):
    return cls(
        out,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    ) if cls.__module__.startswith("transformers") else cls(
        out,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip


def _worker(peer: str, steps: int, out: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    stamps: list[float] = []
    if peer == "engine-loop":
        import meshtrain
        from meshtrain.data.loader import ResumableDataLoader
        from meshtrain.optim.lr_scheduler_types import scheduler_factory
        from meshtrain.trainer import TrainingArguments
        from meshtrain.trainer.setup import param_groups

        args = _args(TrainingArguments, out, steps)
        model = _model()  # the Trainer's weight-decay groups and linear schedule, by hand
        engine, _, _, _ = meshtrain.initialize(
            model=model, model_parameters=param_groups(model), config=args.to_engine_config(steps),
            lr_scheduler=scheduler_factory("linear", 0, steps),
        )  # fmt: skip
        from transformers import default_data_collator

        loader = ResumableDataLoader(
            _data(), BATCH, num_replicas=engine.topology.dp_size, rank=engine.topology.dp_rank,
            seed=42, collate_fn=default_data_collator,
        )  # fmt: skip
        epoch = 0
        while len(stamps) < steps:
            loader.set_epoch(epoch)
            for batch in loader:
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                stamps.append((time.perf_counter(), time.process_time()))
                if len(stamps) >= steps:
                    break
            epoch += 1
    else:
        if peer == "meshtrain":
            from meshtrain import Trainer, TrainerCallback, TrainingArguments
        else:
            from transformers import Trainer, TrainerCallback, TrainingArguments

        class Stamp(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                stamps.append((time.perf_counter(), time.process_time()))

        from transformers import default_data_collator

        trainer = Trainer(
            model=_model(), args=_args(TrainingArguments, out, steps), train_dataset=_data(),
            data_collator=default_data_collator, callbacks=[Stamp()],
        )  # fmt: skip
        trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"rank": rank, "world": world, "stamps": stamps}


def _paired_worker(steps: int, warmup: int, out: str, tiny: bool = False) -> dict:
    """Trainer steps and hand-written steps alternating on one engine (see ``--paired``)."""
    import torch

    global HIDDEN, LAYERS, VOCAB, SEQ, BATCH
    if tiny:
        HIDDEN, LAYERS, VOCAB, SEQ, BATCH = 16, 1, 100, 8, 4

    from meshtrain import Trainer, TrainerCallback, TrainingArguments
    from meshtrain.data.loader import ResumableDataLoader

    torch.set_num_threads(1)
    from transformers import default_data_collator

    clock = time.process_time
    trainer_ms: list[float] = []
    hand_ms: list[float] = []

    class Paired(TrainerCallback):
        def on_train_begin(self, args, state, control, engine=None, **kwargs):
            self.engine, self.epoch = engine, 0
            self.loader = ResumableDataLoader(
                _data(), BATCH, num_replicas=1, rank=0, seed=42, collate_fn=default_data_collator
            )  # fmt: skip
            self.batches = iter(self.loader)
            self.mark = clock()

        def _next(self):
            batch = next(self.batches, None)
            if batch is None:
                self.epoch += 1
                self.loader.set_epoch(self.epoch)
                self.batches = iter(self.loader)
                batch = next(self.batches)
            return batch

        def on_step_end(self, args, state, control, **kwargs):
            trainer_ms.append(1e3 * (clock() - self.mark))  # the Trainer's whole step
            t0 = clock()
            loss = self.engine(**self._next()).loss
            self.engine.backward(loss)
            self.engine.step()
            hand_ms.append(1e3 * (clock() - t0))
            self.mark = clock()

    trainer = Trainer(
        model=_model(), args=_args(TrainingArguments, out, steps), train_dataset=_data(),
        data_collator=default_data_collator, callbacks=[Paired()],
    )  # fmt: skip
    trainer.train()
    t, h = trainer_ms[warmup:], hand_ms[warmup:]
    diff = statistics.median(a - b for a, b in zip(t, h, strict=True))
    return {
        "pairs": len(t),
        "trainer_cpu_ms": statistics.median(t),
        "hand_cpu_ms": statistics.median(h),
        "diff_cpu_ms": diff,
        "overhead": diff / statistics.median(h),
        "load_avg_1min": os.getloadavg()[0],
    }


def _paired(a, tmp: str) -> dict:
    from meshtrain.launch.processes import run_on_ranks

    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    runs = []
    for i in range(a.repeats):
        args = (a.steps, a.warmup, f"{tmp}/paired{i}", a.tiny)
        r = run_on_ranks(_paired_worker, 1, args, {}, timeout=1800, env=env)[0]
        runs.append(r)
        print(f"paired {i}: trainer {r['trainer_cpu_ms']:.2f} ms, hand {r['hand_cpu_ms']:.2f} "
              f"ms CPU per step; difference {r['diff_cpu_ms']:+.3f} ms "
              f"({100 * r['overhead']:+.2f}%; load {r['load_avg_1min']:.1f})", flush=True)  # fmt: skip
    overhead = statistics.median(r["overhead"] for r in runs)
    print(f"paired: trainer overhead {100 * overhead:+.2f}% (median of {len(runs)})", flush=True)
    return {"runs": runs, "trainer_overhead_paired": overhead}


def _run(peer: str, nproc: int, steps: int, warmup: int, tmp: str) -> dict:
    from meshtrain.launch.processes import run_on_ranks

    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    results = run_on_ranks(
        _worker, nproc, (peer, steps, f"{tmp}/{peer}"), {}, timeout=1200, env=env
    )
    stamps = results[0]["stamps"]
    timed = stamps[warmup:]
    step_s = (timed[-1][0] - timed[0][0]) / (len(timed) - 1)
    cpu_s = (timed[-1][1] - timed[0][1]) / (len(timed) - 1)
    return {
        "peer": peer,
        "nproc": nproc,
        "steps": len(stamps),
        "step_ms": 1e3 * step_s,
        "cpu_ms_per_step": 1e3 * cpu_s,
        "samples_per_s": BATCH * nproc / step_s,
        "load_avg_1min": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, action="append")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", action="append", help="default: all three")
    parser.add_argument("--paired", action="store_true", help="in-process overhead (doc)")
    parser.add_argument("--tiny", action="store_true", help="--paired on a tiny BERT")
    parser.add_argument("--out", type=Path)
    a = parser.parse_args(argv)
    import tempfile

    if a.paired:
        with tempfile.TemporaryDirectory() as tmp:
            record = {"benchmark": "bench_trainer --paired", "args": vars(a) | {"out": None}}
            record |= _paired(a, tmp)
        date = _dt.datetime.now(_dt.UTC)
        record["date"] = date.isoformat()
        path = a.out or RESULTS / f"trainer-paired-{date:%Y-%m-%d-%H%M}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
        return 0

    import torch
    import transformers

    peers = tuple(a.peer or ("meshtrain", "transformers", "engine-loop"))
    runs = []
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in a.nproc or [1, 2]:
            by_peer: dict[str, list[float]] = {p: [] for p in peers}
            cpu: dict[str, list[float]] = {p: [] for p in peers}
            for i in range(a.repeats):
                # reversed on odd rounds: a load that rises or falls over the run would
                # otherwise always favour the peer that runs second
                for peer in peers if i % 2 == 0 else peers[::-1]:
                    r = _run(peer, nproc, a.steps, a.warmup, tmp)
                    runs.append(r)
                    by_peer[peer].append(r["samples_per_s"])
                    cpu[peer].append(r["cpu_ms_per_step"])
                    print(f"np{nproc} {peer:13s} {r['samples_per_s']:8.1f} samples/s "
                          f"({r['step_ms']:.1f} ms/step wall, {r['cpu_ms_per_step']:.1f} ms CPU;"
                          f" load {r['load_avg_1min']:.1f})", flush=True)  # fmt: skip
            med = {p: statistics.median(v) for p, v in by_peer.items()}
            med_cpu = {p: statistics.median(v) for p, v in cpu.items()}
            s = summary[f"np{nproc}"] = {"samples_per_s": med, "cpu_ms_per_step": med_cpu}
            if "transformers" in med and "meshtrain" in med:
                s["meshtrain_vs_transformers"] = med["meshtrain"] / med["transformers"]
            if "engine-loop" in med and "meshtrain" in med:
                s["trainer_overhead_vs_engine_loop"] = med["engine-loop"] / med["meshtrain"] - 1
                s["trainer_overhead_cpu"] = med_cpu["meshtrain"] / med_cpu["engine-loop"] - 1
            print(f"np{nproc}: " + ", ".join(f"{k} {v:+.4f}" for k, v in s.items()
                                             if isinstance(v, float)), flush=True)  # fmt: skip
    date = _dt.datetime.now(_dt.UTC)
    record = {
        "benchmark": "bench_trainer",
        "date": date.isoformat(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
        },  # fmt: skip
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },  # fmt: skip
        "args": vars(a) | {"out": str(a.out) if a.out else None},
        "workload": {
            "hidden": HIDDEN,
            "layers": LAYERS,
            "vocab": VOCAB,
            "seq": SEQ,
            "rows": ROWS,
            "per_device_batch": BATCH,
        },  # fmt: skip
        "runs": runs,
        "summary": summary,
    }
    nps = "-".join(f"np{n}" for n in (a.nproc or [1, 2]))
    path = a.out or RESULTS / f"trainer-{date:%Y-%m-%d-%H%M}-{nps}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
