"""Peer checkpoints in and out at 4 ranks: memory per rank and speed, against the peer's own
load and save in the same run (issue 46).

A Llama of about 1 GB of fp32 weights (random values) is written once as a sharded
``save_pretrained`` folder. Then, each in fresh ``torchrun`` processes (4 ranks, gloo, one
thread each), the timed call alone, with the peak RSS reset just before it
(``/proc/self/clear_refs`` 5) so that ``VmHWM`` afterwards is the call's own peak:

* **write a sharded transformers folder** (``max_shard_size="200MB"``):
  meshtrain ``engine.save_weights`` at ZeRO-3 (each file written by the rank holding most
  of it) against FSDP2's documented way to the same folder: ``get_model_state_dict(
  full_state_dict=True, cpu_offload=True)`` (rank 0 gets the whole model) and rank 0's
  ``save_pretrained(state_dict=...)``;
* **import a peer checkpoint**: the DCP folder FSDP2 wrote with ``dcp.save`` (the model,
  ~1 GB), through meshtrain's ``engine.load_checkpoint(dir, load_optimizer_states=False)``
  at ZeRO-3 against FSDP2's own ``dcp.load`` + ``set_model_state_dict``.

Per row: seconds of the call (the slowest rank), each rank's peak RSS growth over its
RSS just before the call, and the worst rank's growth against the model's bytes. Targets
(the issue's): each rank <= 0.35 x the model, and meshtrain >= 1.0x the peer's speed.

    python -m benchmarks.bench_peer_checkpoints [--layers 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
SHARD = "200MB"
RANKS = 4


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> float:
    """Reset the peak RSS to the current RSS; return it (MiB)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _fsdp2_model(folder: str, with_weights: bool):
    """The model under FSDP2 (every decoder layer and the root), built on the meta device
    and materialised shard by shard; ``with_weights``: the folder's weights (so its save
    can be compared with meshtrain's), else random ones that the timed load replaces."""
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (RANKS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if with_weights:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        full = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            full.update(load_file(f))
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        del full
    return model


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    if args.how.endswith("meshtrain"):
        import meshtrain

        config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, **ZERO3}  # fmt: skip
        engine, *_ = meshtrain.from_pretrained(args.folder, config)
        if args.how == "load-meshtrain":  # meshtrain's reader opened once before (imports)
            engine.load_checkpoint(args.dcp, load_optimizer_states=False,
                                   load_lr_scheduler_states=False)  # fmt: skip
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        model = _fsdp2_model(args.folder, with_weights=args.how == "write-fsdp2")
    dist.barrier()
    before = _reset_peak()
    t0 = time.perf_counter()
    if args.how == "write-meshtrain":
        engine.save_weights(out / "meshtrain", max_shard_size=SHARD)
    elif args.how == "load-meshtrain":
        profile = os.environ.get("MESHTRAIN_BENCH_PROFILE") if rank == 0 else None
        if profile:  # where the import's time goes, on rank 0 (pstats file)
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        engine.load_checkpoint(args.dcp, load_optimizer_states=False,
                               load_lr_scheduler_states=False)  # fmt: skip
        if profile:
            prof.disable()
            prof.dump_stats(profile)
    elif args.how == "write-fsdp2":
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(model, options=opts)
        if rank == 0:
            model.save_pretrained(out / "fsdp2", state_dict=sd, max_shard_size=SHARD)
        del sd
    elif args.how == "load-fsdp2":
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=args.dcp)
        set_model_state_dict(model, sd)
        del sd
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM")
    if args.how == "write-fsdp2" and not Path(args.dcp).exists():
        dcp.save(get_model_state_dict(model), checkpoint_id=args.dcp)  # the import's input
    row = {"rank": rank, "before_mib": before, "peak_mib": peak, "growth_mib": peak - before,
           "seconds": seconds}  # fmt: skip
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(args.result).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _run(how: str, folder: Path, dcp: Path, tmp: Path) -> list[dict]:
    result = tmp / f"{how}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(RANKS), str(Path(__file__)), "--worker", "--how", how, "--folder", str(folder),
           "--dcp", str(dcp), "--out", str(tmp / "out"), "--result", str(result)]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, timeout=1800)
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--how", "--folder", "--dcp", "--out", "--result"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--keep", default=None, help="reuse/keep the model folder here")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="meshtrain-peer-ckpt-"))
    folder = Path(args.keep) if args.keep else tmp / "llama"
    info_file = folder / "bench_info.json"
    if info_file.is_file():
        info = json.loads(info_file.read_text())
    else:  # here, not at the top: the workers run this file by its path, not as a module
        from benchmarks.bench_sliced_load import write_llama

        info = write_llama(folder, args.layers)  # the sliced-load benchmark's model
        info_file.write_text(json.dumps(info))
    model_mib = info["model_bytes"] / 2**20
    print(f"model: {model_mib:.0f} MiB fp32, largest tensor "
          f"{info['largest_tensor_bytes'] / 2**20:.0f} MiB; {RANKS} ranks", flush=True)  # fmt: skip
    dcp = tmp / "fsdp2_dcp"
    load_before = os.getloadavg()  # the box is shared: say how busy it was
    table = {}
    try:
        # FSDP2's write first: it also leaves the DCP folder the imports read
        for how in ("write-fsdp2", "write-meshtrain", "load-fsdp2", "load-meshtrain"):
            rows = _run(how, folder, dcp, tmp)
            table[how] = rows
            worst = max(r["growth_mib"] for r in rows)
            secs = max(r["seconds"] for r in rows)
            print(f"{how:16s} {secs:6.2f} s  worst rank growth {worst:6.0f} MiB = "
                  f"{worst / model_mib:.3f} x model", flush=True)  # fmt: skip
        same = _same_folder(tmp / "out" / "meshtrain", tmp / "out" / "fsdp2")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    print(f"meshtrain's folder equals FSDP2's (names, index, tensors): {same}")
    print("\n| call | s (slowest rank) | peak RSS growth per rank (MiB) | worst / model |")
    print("|---|---|---|---|")
    for how, rows in table.items():
        growth = ", ".join(f"{r['growth_mib']:.0f}" for r in rows)
        worst = max(r["growth_mib"] for r in rows) / model_mib
        print(f"| {how} | {max(r['seconds'] for r in rows):.2f} | {growth} | {worst:.3f} |")
    for what in ("write", "load"):
        mt, peer = table[f"{what}-meshtrain"], table[f"{what}-fsdp2"]
        speed = max(r["seconds"] for r in peer) / max(r["seconds"] for r in mt)
        mem = max(r["growth_mib"] for r in mt) / max(max(r["growth_mib"] for r in peer), 1e-9)
        print(f"pair {what} meshtrain vs fsdp2: speed {speed:.2f}x rss growth {mem:.2f}x")
    out = HERE / "results" / f"peer-checkpoints-{time.strftime('%Y-%m-%d-%H%M')}.json"
    import torch

    out.write_text(json.dumps({
        "model_mib": model_mib, "layers": args.layers, "ranks": RANKS, "table": table,
        "same_folder": same, "machine": platform.platform(), "torch": torch.__version__,
        "load_average_before": load_before, "load_average_after": load_after,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }, indent=2))  # fmt: skip
    print(f"results: {out}")
    return 0


def _same_folder(ours: Path, peer: Path) -> bool:
    """The same file names and index, and every tensor equal (safetensors' own reader)."""
    from safetensors import safe_open

    names = sorted(p.name for p in ours.glob("model*.safetensors*"))
    if names != sorted(p.name for p in peer.glob("model*.safetensors*")):
        return False
    index = "model.safetensors.index.json"
    if json.loads((ours / index).read_text()) != json.loads((peer / index).read_text()):
        return False
    import torch

    for name in names:
        if not name.endswith(".safetensors"):
            continue
        with safe_open(ours / name, "pt") as a, safe_open(peer / name, "pt") as b:
            if set(a.keys()) != set(b.keys()):
                return False
            if not all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys()):  # noqa: SIM118 (safe_open is not a dict)
                return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
