"""The single-device memory levers of seed 004, measured on one model, with the
estimator's prediction beside each (regenerates the table in docs/memory.md).

Model: ``meshtrain.models.Decoder`` (dim 256, 4 layers, 4 heads, SwiGLU 688, vocab 4096,
sequence 64 tokens), trained for ``--steps`` steps through ``meshtrain.initialize``. Each
lever runs in a fresh process (``torchrun`` for the ZeRO levers at 2 ranks), one thread.

Measured: peak memory = ``VmHWM`` minus the RSS just before the model is built (so the
torch/python baseline is left out), the largest rank; samples/s over the timed steps
(after one warm-up step; two for torch.compile, whose first step compiles, so its peak
includes the compiler's own memory). This machine has no GPU: memory is host RSS, so offload moves
nothing "off the device" here, and speed is CPU speed on a shared, loaded host: the
``os.getloadavg()`` before and after is printed with the table. Predicted: the model
states of ``meshtrain.estimate.model_states_bytes`` (parameters + gradients + optimizer
states per rank, host part included); activations are not in the estimate.

    python benchmarks/bench_memory_levers.py [--steps 3] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024

# name: (ranks, batch per rank, config overrides, lora)
LEVERS: dict[str, tuple[int, int, dict, bool]] = {
    "baseline fp32 AdamW, batch 8": (1, 8, {}, False),
    "batch 2": (1, 2, {}, False),
    "batch 32": (1, 32, {}, False),
    "grad accumulation 4 x batch 2": (1, 2, {"gradient_accumulation_steps": 4}, False),
    "activation checkpointing": (1, 8, {"activation_checkpointing": {"enabled": True}}, False),
    "bf16, batch 8": (1, 8, {"bf16": {"enabled": True}}, False),
    "fp32, batch 1": (1, 1, {}, False),
    "bf16, batch 1": (1, 1, {"bf16": {"enabled": True}}, False),
    "bf16, batch 32": (1, 32, {"bf16": {"enabled": True}}, False),
    "SGD (no momentum)": (1, 8, {"optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}, False),
    "AdamW8bit (bitsandbytes)": (1, 8, {"optimizer": {"type": "AdamW8bit"}}, False),
    "Lion (bitsandbytes, 32-bit)": (1, 8, {"optimizer": {"type": "Lion"}}, False),
    "Adafactor (torch)": (1, 8, {"optimizer": {"type": "Adafactor"}}, False),
    "bf16 + AC + AdamW8bit": (
        1,
        8,
        {
            "bf16": {"enabled": True},
            "activation_checkpointing": {"enabled": True},
            "optimizer": {"type": "AdamW8bit"},
        },
        False,
    ),
    "AdamW8bit + ZeRO 2 (2 ranks)": (
        2,
        8,
        {"optimizer": {"type": "AdamW8bit"}, "zero_optimization": {"stage": 2}},
        False,
    ),
    "chunked loss (loss.chunked, 256 tokens/chunk)": (
        1,
        8,
        {"loss": {"chunked": True, "chunk_size": 256}},
        False,
    ),
    "ZeRO 1 (2 ranks)": (2, 8, {"zero_optimization": {"stage": 1}}, False),
    "ZeRO 2 (2 ranks)": (2, 8, {"zero_optimization": {"stage": 2}}, False),
    "ZeRO 3 (2 ranks)": (2, 8, {"zero_optimization": {"stage": 3}}, False),
    "ZeRO 2 + CPU offload (2 ranks)": (
        2,
        8,
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        False,
    ),
    "torch.compile": (1, 8, {"compile": {"enabled": True}}, False),
    "LoRA r=8 on q/v": (1, 8, {}, True),
    "LoRA r=8 on q/v, ZeRO 3 (2 ranks)": (2, 8, {"zero_optimization": {"stage": 3}}, True),
}


def _rss_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def worker(name: str, steps: int, out: str) -> None:
    import torch

    import meshtrain
    from meshtrain.estimate.model_states import model_states_bytes
    from meshtrain.models.decoder import Decoder, DecoderConfig

    torch.set_num_threads(1)
    ranks, batch, overrides, lora = LEVERS[name]
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **overrides,
    }
    if lora:
        from peft import LoraConfig, get_peft_model
    import meshtrain.engine.engine  # noqa: F401  (imports are not the lever's memory)

    base = _rss_kib("VmRSS")
    model = Decoder(DecoderConfig(vocab_size=4096, max_seq_len=64))
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    # predicted before initialize: under ZeRO-3 the module's parameters become shards
    from meshtrain.config import load_config

    cfg = load_config(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    dp = int(os.environ.get("WORLD_SIZE", "1"))
    z = cfg.zero_optimization
    opt = cfg.optimizer.type
    compiled = bool(overrides.get("compile", {}).get("enabled"))
    predicted = model_states_bytes(
        model if not lora else sum(p.numel() for p in model.parameters() if p.requires_grad),
        dp=dp,
        stage=int(z.stage),
        precision=cfg.precision,
        optimizer="SGD" if opt.lower() == "sgd" else opt,
        offload_optimizer=z.offload_optimizer is not None and z.offload_optimizer.device == "cpu",
        frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad)
        if lora
        else 0,
    )
    engine, *_ = meshtrain.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(engine.topology.rank)
    t0 = None
    warmup = 2 if compiled else 1  # torch.compile: the first steps compile (fwd, then bwd)
    for step in range(steps + warmup):
        if step == warmup:
            t0 = time.perf_counter()
        for _ in range(engine.gas):
            ids = torch.randint(0, 4096, (batch, 64), generator=g)
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
    elapsed = torch.tensor([time.perf_counter() - t0])
    peak = torch.tensor([float(_rss_kib("VmHWM") - base)])
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if engine.topology.rank == 0:
        samples = steps * engine.gas * batch * engine.topology.dp_size
        Path(out).write_text(
            json.dumps(
                {
                    "peak_mib": peak.item() / 1024,
                    "samples_per_s": samples / elapsed.item(),
                    "predicted_mib": (predicted.total + predicted.host) / MiB,
                    "params": sum(p.numel() for p in model.parameters()),
                }
            )
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--only", default=None, help="lever names, ';'-separated (',' when no ';' is given)"
    )
    p.add_argument("--worker", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    sep = ";" if args.only and ";" in args.only else ","
    names = [n.strip() for n in args.only.split(sep)] if args.only else list(LEVERS)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    load_before = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            out = os.path.join(tmp, f"{i}.json")
            ranks = LEVERS[name][0]
            launch = (
                [sys.executable]
                if ranks == 1
                else [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={ranks}",
                ]
            )
            cmd = [*launch, __file__, "--worker", name, "--steps", str(args.steps), "--out", out]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if not os.path.exists(out):
                print(
                    f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-1500:]}", file=sys.stderr
                )
                continue
            rows[name] = json.loads(Path(out).read_text())
            r = rows[name]
            print(
                f"{name:<34} peak {r['peak_mib']:7.1f} MiB  predicted states {r['predicted_mib']:7.1f} MiB  {r['samples_per_s']:7.1f} samples/s",
                flush=True,
            )
    load_after = os.getloadavg()
    print(f"\nloadavg before {load_before}, after {load_after}, {os.cpu_count()} CPUs\n")
    print(
        "| lever | ranks | peak memory (MiB, largest rank) | estimator: model states (MiB) | samples/s |"
    )
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {LEVERS[name][0]} | {r['peak_mib']:.1f} | {r['predicted_mib']:.1f} | {r['samples_per_s']:.1f} |"
        )
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"bench_memory_levers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {"rows": rows, "loadavg_before": load_before, "loadavg_after": load_after}, indent=2
        )
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
