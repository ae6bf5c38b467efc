"""Warm checkpoint loads with verification, measured only at moments when a core is free.

    python -m benchmarks.bench_hash_thread [--mib 128] [--seconds 120] [--json OUT]

On a shared machine the other sessions decide whether a second core is free, and that
decides what the hashing thread (``meshtrain.files.hash_thread``) can do. This benchmark
saves one checkpoint (8 fp32 tensors), then for ``--seconds`` repeatedly looks at the run
queue (``hash_thread.core_free``: fewer runnable tasks than cores); each time a core is
free it runs one set of warm loads (every tensor read through ``CheckpointReader``, the
file in the page cache), in an order that rotates set by set:

* ``no verify``: ``CheckpointReader(verify=False)``;
* ``inline``: verified, each block hashed on the reading thread right after it lands;
* ``thread``: verified, every key hashed on the hashing thread (never declined).

A set is kept only if the run queue still showed a free core after it. Printed: the
medians over the sets kept, ratios to ``no verify`` (wall, and CPU of all threads), how
many sets were kept and how many looks found no core free. This is the condition under
which the load hands keys to the thread; ``bench_integrity`` measures all conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from benchmarks.bench_integrity import _save, _state
from meshtrain.checkpoint import CheckpointReader
from meshtrain.files import hash_thread

MODES = {
    "no verify": (False, {}),
    "inline": (True, {"usable": lambda: False}),
    "thread": (True, {"usable": lambda: True, "core_free": lambda: True, "INLINE_BYTES_PER_S": 0}),
}


def _load(root: Path, verify: bool, patches: dict) -> tuple[float, float]:
    with mock.patch.multiple(hash_thread, **patches) if patches else mock.patch.dict({}):
        t0, c0 = time.perf_counter(), time.process_time()
        with CheckpointReader(root, "c", verify=verify) as r:
            for name in r.names():
                r.read(name)
        return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    tensors, pieces, meta = _state(args.mib)
    wall: dict[str, list[float]] = {k: [] for k in MODES}
    cpu: dict[str, list[float]] = {k: [] for k in MODES}
    busy = dropped = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _save(root, "c", tensors, pieces, meta, "checksums")
        _load(root, False, {})  # in the page cache
        names = list(MODES)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            if not hash_thread.core_free():
                busy += 1
                time.sleep(0.01)
                continue
            k = (len(wall["no verify"]) + dropped) % len(names)
            got = {n: _load(root, *MODES[n]) for n in names[k:] + names[:k]}
            if not hash_thread.core_free():
                dropped += 1  # someone started running meanwhile: not a free-core sample
                continue
            for n, (w, c) in got.items():
                wall[n].append(w)
                cpu[n].append(c)
    kept = len(wall["no verify"])
    print(
        f"checkpoint of {args.mib} MiB, {kept} sets of warm loads at a free core "
        f"({dropped} dropped: busy after; {busy} looks found no core free)"
    )
    if not kept:
        print("no free core in the time given: nothing measured")
        return 1
    med = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    base, cbase = med["no verify"], cmed["no verify"]
    for k in MODES:
        print(
            f"  {k:10s} wall {med[k] * 1e3:7.2f} ms ({med[k] / base:.3f}x)   "
            f"cpu {cmed[k] * 1e3:7.2f} ms ({cmed[k] / cbase:.3f}x)"
        )
    print(f"load average at the start: {load_start}, at the end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({
            "bench": "hash_thread", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": platform.platform(), "cpus": os.cpu_count(), "mib": args.mib,
            "wall_s": wall, "cpu_s": cpu, "median_s": med, "cpu_median_s": cmed,
            "kept": kept, "dropped": dropped, "busy_looks": busy,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
