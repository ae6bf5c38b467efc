"""Peak host memory of loading a ~1 GB transformers checkpoint into a parallel layout.

Issue 31's memory table. A Llama of about 1 GB of fp32 weights with random values is
written once as a sharded ``save_pretrained`` folder; then, in one run, each of these
loads it in fresh processes and reports, per rank, the peak RSS (``ru_maxrss``) minus the
RSS just before loading (after the process group, the imports and a tiny model through the same path, so that
imports and one-time set-up are not counted):

* ``transformers``: ``LlamaForCausalLM.from_pretrained`` in one process;
* ``today <layout>``: that on every rank, then ``meshtrain.initialize`` (the path before
  ``meshtrain.from_pretrained``);
* ``sliced <layout>``: ``meshtrain.from_pretrained`` (untouched storage, the layout,
  then each rank's slices).

Layouts: ZeRO-3 at 4 ranks, tp 4, tp 2 x pp 2. Targets (the issue's): ZeRO-3 and tp 4
each rank <= 0.35 x the model's bytes; tp 2 x pp 2 the rank's slice plus at most the
largest tensor.

    python -m benchmarks.bench_sliced_load [--layers 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYOUTS = {
    "zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    "tp4": {"mesh": {"tensor_parallel_size": 4}, "zero_optimization": {"stage": 1}},
    "tp2pp2": {
        "mesh": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
        "zero_optimization": {"stage": 1},
    },
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def llama_config(layers: int):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
        max_position_embeddings=256,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def write_llama(folder: Path, layers: int) -> dict:
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = transformers.LlamaForCausalLM(llama_config(layers))
    g = torch.Generator().manual_seed(0)
    sizes = []
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
            sizes.append(p.numel() * 4)
    model.save_pretrained(folder, max_shard_size="200MB")
    return {"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}


def _worker(args) -> None:
    import torch
    import transformers

    import meshtrain

    torch.set_num_threads(1)
    meshtrain.init_distributed()
    import torch.distributed as dist

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 10**6,
        **LAYOUTS.get(args.layout, {}),
    }
    # the code every path runs is imported (and its one-time set-up done) before the
    # baseline: a tiny model through the same path, so the growth is the model's
    _ = transformers.LlamaForCausalLM
    if args.how != "transformers":
        import meshtrain.interop.from_pretrained

        tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4))  # fmt: skip
        warm = {**config, **LAYOUTS.get(args.layout, {})}
        meshtrain.initialize(model=tiny, config=warm)
        del tiny
    import gc

    gc.collect()
    before = _rss_mib()
    if args.how == "transformers":
        transformers.LlamaForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    elif args.how == "today":
        model = transformers.LlamaForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
        engine, *_ = meshtrain.initialize(model=model, config=config)
        del model
    else:
        engine, *_ = meshtrain.from_pretrained(args.folder, config)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held = 0
    if args.how != "transformers":
        # this rank's slice: the fp32 bytes of the parameters it holds (masters)
        held = sum(m.numel() * 4 for g in engine.zero.flat_groups for m in g.master_chunks)
    row = {"rank": dist.get_rank(), "before_mib": before, "peak_mib": peak,
           "growth_mib": peak - before, "slice_mib": held / 2**20}  # fmt: skip
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(rows))
    dist.barrier()


def _run(how: str, layout: str, nproc: int, folder: Path, tmp: Path) -> list[dict]:
    result = tmp / f"{how}-{layout}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), str(Path(__file__)), "--worker", "--how", how, "--layout", layout,
           "--folder", str(folder), "--result", str(result)]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, timeout=1800)
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--how", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--layouts", default="zero3,tp4,tp2pp2")
    ap.add_argument("--paths", default="transformers,today,sliced")
    ap.add_argument("--keep", default=None, help="reuse/keep the checkpoint folder here")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="meshtrain-sliced-"))
    folder = Path(args.keep) if args.keep else tmp / "llama"
    info_file = folder / "bench_info.json"
    if info_file.is_file():
        info = json.loads(info_file.read_text())
    else:
        info = write_llama(folder, args.layers)
        info_file.write_text(json.dumps(info))
    model_mib = info["model_bytes"] / 2**20
    largest_mib = info["largest_tensor_bytes"] / 2**20
    print(f"model: {model_mib:.0f} MiB fp32, largest tensor {largest_mib:.0f} MiB", flush=True)
    table = []
    load_before = os.getloadavg()  # the box is shared: say how busy it was
    try:
        paths = args.paths.split(",")
        if "transformers" in paths:
            rows = _run("transformers", "", 1, folder, tmp)
            table.append(("transformers from_pretrained", 1, rows))
        for layout in args.layouts.split(","):
            for how in [p for p in ("today", "sliced") if p in paths]:
                rows = _run(how, layout, 4, folder, tmp)
                table.append((f"{how} {layout}", 4, rows))
                worst = max(r["growth_mib"] for r in rows)
                print(f"{how:8s} {layout:7s} worst rank growth {worst:7.0f} MiB = "
                      f"{worst / model_mib:.3f} x model", flush=True)  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    print("\n| path | ranks | peak RSS growth per rank (MiB) | worst / model | slice (MiB) |")
    print("|---|---|---|---|---|")
    for name, n, rows in table:
        growth = ", ".join(f"{r['growth_mib']:.0f}" for r in rows)
        worst = max(r["growth_mib"] for r in rows) / model_mib
        sl = ", ".join(f"{r['slice_mib']:.0f}" for r in rows)
        print(f"| {name} | {n} | {growth} | {worst:.3f} | {sl} |")
    out = HERE / "results" / f"sliced-load-{time.strftime('%Y-%m-%d-%H%M')}.json"
    import torch

    out.write_text(json.dumps({
        "model_mib": model_mib, "largest_tensor_mib": largest_mib, "layers": args.layers,
        "table": [{"path": n, "ranks": k, "rows": r} for n, k, r in table],
        "machine": platform.platform(), "torch": torch.__version__,
        "load_average_before": load_before, "load_average_after": load_after,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }, indent=2))  # fmt: skip
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
