"""Checkpoint save and load throughput with checksum verification on and off, in one run.

    python -m benchmarks.bench_integrity [--mib 512] [--rounds 5] [--load-repeats 1]
                                         [--json OUT]

One process saves a checkpoint of ``--mib`` MiB (8 fp32 tensors, ``save_shards`` with
``group=None``: write, fsync, commit) and loads it back whole (``CheckpointReader.read``
of every tensor), alternating the variants round by round so that load on the shared
machine hits them alike; the median of ``--rounds`` is reported:

* save ``checksums``: what meshtrain does (per-tensor xxh3-64 of the tensors written,
  hashed while fsync waits for the disk; manifest sealed);
  save ``none``: the same with ``tensor_files.tensor_digests`` hashing nothing (the cost
  of hashing, isolated); save ``sha256 pass``: the earliest implementation's second read
  of the written file with sha256, for reference;
* load ``verify``: ``CheckpointReader.read`` of every tensor, each block read into the
  tensor returned and hashed right after it lands (``checkpoint.rank_file``); ``no
  verify``: the same with ``CheckpointReader(verify=False)``;
* ``verify`` and ``no verify`` ``cold``: the rank file is dropped from the page cache first
  (``posix_fadvise(DONTNEED)`` on that file only), so the bytes come from the disk, as
  when a job restarts on a fresh node.

Before each save the previous one is deleted and ``os.sync()`` flushes dirty pages, and
the order of the save variants, and of the loads, rotates round by round, so that writeback of one save does not land on
the next. ``--dir /dev/shm`` takes the disk out and leaves the compute cost (tmpfs).
Warm loads read from the page cache (the file was just written): the load is then a
memory copy, the worst case for the relative cost of verification.
Ratios of wall and of CPU time (the process's, all threads) are printed, with the load
average; the goal (issue 32) is verification within 5% of none.

``--resume-rounds N`` adds the loads a user runs, each in a fresh process (the memory it
loads into is new to it) with the files in the page cache, ``MESHTRAIN_VERIFY=1`` against
``=0``, alternating, only the call timed, on a checkpoint of a GPT-2-shaped model from
``transformers`` (4 layers, width 512, 8,192-token vocabulary: 16.9 M parameters, 193 MiB
with both AdamW moments):

* ``restart``: ``engine.load_checkpoint`` into a freshly built engine;
* ``consolidate``: ``meshtrain.checkpoint.consolidate`` into a ``save_pretrained``
  folder (weights, ``config.json`` and the checksum sidecar written, fsync included);
* ``serve export``: how ``meshtrain serve`` loads that folder (the export's checksums,
  then ``from_pretrained``);
* ``serve checkpoint``: how it loads the checkpoint itself (each tensor sliced from the
  rank file into a model built on the meta device).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from meshtrain.checkpoint import CheckpointReader, Piece, save_shards, storage, tensor_files

NAMES = (
    "save checksums",
    "save none",
    "save sha256 pass",
    "load verify",
    "load no verify",
    "load verify, cold",
    "load no verify, cold",
)


def _state(mib: int) -> tuple[dict, list, dict]:
    n = mib * (1 << 20) // 4 // 8
    g = torch.Generator().manual_seed(0)
    tensors, pieces, specs = {}, [], {}
    for i in range(8):
        tensors[f"t{i}"] = torch.randn(n, generator=g)
        pieces.append(Piece(f"w{i}", "param", f"t{i}", 0, 0, n))
        specs[f"w{i}"] = {"shape": [n], "dtype": "float32", "kind": "param"}
    return tensors, pieces, {"tensors": specs}


def _no_digests(host):
    return {}, {}


def _sha_record(path, digests, parts=None):
    storage.sha256_file(Path(path))  # the second pass over the written file
    return {"algo": "xxh3_64", "size": Path(path).stat().st_size, "header": "", "tensors": {}}


def _save(root: Path, tag: str, tensors, pieces, meta, variant) -> tuple[float, float]:
    patches = {
        "checksums": {},
        "none": {"tensor_digests": _no_digests},
        "sha256": {"tensor_digests": _no_digests, "record_from_tensors": _sha_record},
    }[variant]
    with contextlib.ExitStack() as stack:
        for attr, fn in patches.items():
            stack.enter_context(mock.patch.object(tensor_files, attr, fn))
        t0, c0 = time.perf_counter(), time.process_time()
        save_shards(root, tag, group=None, tensors=tensors, pieces=pieces, meta=meta)
        return time.perf_counter() - t0, time.process_time() - c0


def _evict(root: Path, tag: str) -> None:
    """Drop this checkpoint's files from the page cache (clean pages: saved and synced)."""
    for f in (root / tag).iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load(root: Path, tag: str, verify: bool, cold: bool = False) -> tuple[float, float]:
    """Wall and CPU seconds (all threads) of reading every tensor."""
    if cold:
        _evict(root, tag)
    t0, c0 = time.perf_counter(), time.process_time()
    with CheckpointReader(root, tag, verify=verify) as r:
        for name in r.names():
            r.read(name)
    return time.perf_counter() - t0, time.process_time() - c0


def _resume_engine():
    import transformers

    import meshtrain

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=8192, n_positions=128, n_embd=512, n_layer=4, n_head=8
    )
    model = transformers.GPT2LMHeadModel(config)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    return meshtrain.initialize(model=model, config=cfg)[0]


def _resume_worker(save_dir: str, mode: str) -> None:
    """``save``: one step, a checkpoint and its export; else print the seconds (wall, CPU)
    of one user operation (module docstring) as JSON."""
    from meshtrain.checkpoint import consolidate
    from meshtrain.serve import model_loading

    root = Path(save_dir)
    engine = _resume_engine() if mode in ("save", "restart") else None
    if mode == "save":
        ids = torch.randint(0, 8192, (2, 64))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(root / "ckpt", tag="t")
        consolidate(root / "ckpt", root / "export", progress=False)
        return
    ops = {
        "restart": lambda: engine.load_checkpoint(root / "ckpt", tag="t"),
        "consolidate": lambda: consolidate(root / "ckpt", root / "out", progress=False),
        "serve export": lambda: model_loading._load_pretrained(
            model_loading.resolve(root / "export"), None, None
        ),
        "serve checkpoint": lambda: model_loading._load_sharded(
            model_loading.resolve(root / "ckpt", "t"), None, None
        ),
    }
    t0, c0 = time.perf_counter(), time.process_time()
    ops[mode]()
    print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}))


RESUME_OPS = ("restart", "consolidate", "serve export", "serve checkpoint")


def _resume(rounds: int, tmp: Path) -> dict:
    """Fresh-process user operations with and without verification (module docstring)."""
    import subprocess
    import sys

    def run(mode: str, verify: str) -> dict:
        env = {**os.environ, "MESHTRAIN_VERIFY": verify, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "benchmarks.bench_integrity", "--resume-worker", str(tmp)]
        out = subprocess.run(cmd + [mode], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1]) if mode != "save" else {}

    run("save", "1")
    result = {}
    for op in RESUME_OPS:
        got: dict[str, list[dict]] = {"1": [], "0": []}
        for rnd in range(rounds):
            for v in ("1", "0") if rnd % 2 == 0 else ("0", "1"):
                got[v].append(run(op, v))
        wall = {v: statistics.median(x["wall"] for x in r) for v, r in got.items()}
        cpu = {v: statistics.median(x["cpu"] for x in r) for v, r in got.items()}
        print(
            f"{op} (fresh process, page cache, median of {rounds}): "
            f"verify {1000 * wall['1']:.1f} ms, none {1000 * wall['0']:.1f} ms: "
            f"wall {wall['1'] / wall['0']:.3f}x | cpu {cpu['1'] / cpu['0']:.3f}x"
        )
        result[op] = {
            "runs": got,
            "wall_ratio": wall["1"] / wall["0"],
            "cpu_ratio": cpu["1"] / cpu["0"],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--load-repeats",
        type=int,
        default=1,
        help="warm loads per round and variant (they are short: more samples, same time)",
    )
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--resume-rounds", type=int, default=0, help="fresh-process engine loads")
    p.add_argument("--resume-worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resume_worker:
        _resume_worker(*args.resume_worker)
        return 0
    load_start = os.getloadavg()
    tensors, pieces, meta = _state(args.mib)
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    cpu: dict[str, list[float]] = {k: [] for k in NAMES}
    times: dict[str, list[float]] = {k: [] for k in NAMES}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        saves = [
            ("save checksums", "checksums"),
            ("save none", "none"),
            ("save sha256 pass", "sha256"),
        ]
        for rnd in range(args.rounds):
            k = rnd % len(saves)  # rotate: each variant runs first, middle and last alike
            for name, rec in saves[k:] + saves[:k]:
                shutil.rmtree(root, ignore_errors=True)
                os.sync()  # start every save with no dirty pages of the one before
                wall, c = _save(root, "c", tensors, pieces, meta, rec)
                times[name].append(wall)
                cpu[name].append(c)
            shutil.rmtree(root, ignore_errors=True)
            _save(root, "c", tensors, pieces, meta, "checksums")  # the loads read a real one
            os.sync()
            _load(root, "c", False)  # warm the page cache for both
            loads = [
                ("load verify", True, False),
                ("load no verify", False, False),
                ("load verify, cold", True, True),
                ("load no verify, cold", False, True),
            ]
            k = rnd % len(loads)  # rotate, as the saves
            warm = [x for x in loads if not x[2]]
            extra = [warm[(j + k) % len(warm)] for j in range(len(warm) * (args.load_repeats - 1))]
            for name, verify, cold in loads[k:] + loads[:k] + extra:
                if not cold:
                    _load(root, "c", False)  # back in the page cache after a cold one
                wall, c = _load(root, "c", verify, cold)
                times[name].append(wall)
                cpu[name].append(c)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    best = {k: min(v) for k, v in times.items()}  # the least disturbed run of each
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    print(
        f"checkpoint of {nbytes / 2**20:.0f} MiB, median of {args.rounds} rounds "
        f"({args.rounds * args.load_repeats} warm loads of each variant)"
    )
    for k in times:
        print(f"  {k:20s} wall {med[k]:7.3f} s  {gbs[k]:6.2f} GB/s   cpu {cmed[k]:7.3f} s")
    save_ratio = med["save checksums"] / med["save none"]
    load_ratio = med["load verify"] / med["load no verify"]
    cold_ratio = med["load verify, cold"] / med["load no verify, cold"]
    c_save = cmed["save checksums"] / cmed["save none"]
    c_load = cmed["load verify"] / cmed["load no verify"]
    print("ratios to no checksums: wall (median) | cpu (median) | wall (fastest run)")
    rows = [
        ("save", "save checksums", "save none"),
        ("save, sha256 second pass", "save sha256 pass", "save none"),
        ("load (from the page cache)", "load verify", "load no verify"),
        ("load from the disk (cold)", "load verify, cold", "load no verify, cold"),
    ]
    ratios = {}
    for label, a, b in rows:
        ratios[label] = (med[a] / med[b], cmed[a] / cmed[b], best[a] / best[b])
        w, c, f = ratios[label]
        print(f"  {label:26s} {w:6.3f}x | {c:6.3f}x | {f:6.3f}x")
    resume = None
    if args.resume_rounds:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            resume = _resume(args.resume_rounds, Path(tmp))
    print(f"load average at the start: {load_start}, at the end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({
            "bench": "integrity", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "mib": args.mib, "rounds": args.rounds,
            "load_repeats": args.load_repeats,
            "times_s": times, "median_s": med, "gb_per_s": gbs, "cpu_s": cpu, "cpu_median_s": cmed, "min_s": best,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "save_ratio": save_ratio, "load_ratio": load_ratio, "cold_load_ratio": cold_ratio,
            "cpu_save_ratio": c_save, "cpu_load_ratio": c_load,
            "ratios_wall_cpu_fastest": ratios, "resume": resume,
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
