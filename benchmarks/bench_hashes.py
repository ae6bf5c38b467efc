"""Throughput of the candidate checksum hashes on this CPU, one core, in GB/s.

    python -m benchmarks.bench_hashes [--mib 256] [--reps 7] [--json OUT]

Two cases, each the best of ``--reps`` (the run least disturbed by other processes on a
shared machine), with the median beside it:

* ``cached``: one 256 KiB block (a load's read size, ``checkpoint.rank_file.BLOCK``)
  hashed over and over, so the bytes are in the core's L2 cache: what hashing a block
  right after ``readinto`` wrote it costs;
* ``memory``: ``--mib`` MiB of random bytes hashed in 256 KiB updates, front to back,
  from DRAM: what a separate pass over a tensor in memory costs (a save hashes tensors so).

Candidates, each from a maintained library (a missing optional one is skipped and named):
``xxhash`` (xxh3-64, xxh3-128, xxh64), ``hashlib`` (sha256, sha1, md5, blake2b),
``zlib.crc32``, ``crc32c`` (the ``crc32c`` package), ``google_crc32c`` and ``blake3``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time
import zlib
from collections.abc import Callable
from pathlib import Path

BLOCK = 1 << 18


def _candidates() -> tuple[dict[str, Callable[[], object]], list[str]]:
    """``{name: factory of an object with update(bytes-like)}``, and what was skipped."""
    out: dict[str, Callable[[], object]] = {}
    skipped = []
    try:
        import xxhash

        out["xxh3_64 (xxhash)"] = xxhash.xxh3_64
        out["xxh3_128 (xxhash)"] = xxhash.xxh3_128
        out["xxh64 (xxhash)"] = xxhash.xxh64
    except ImportError:
        skipped.append("xxhash")
    for name in ("sha256", "sha1", "md5", "blake2b"):
        out[f"{name} (hashlib)"] = getattr(hashlib, name)
    out["crc32 (zlib)"] = lambda: _Running(zlib.crc32)
    try:
        import crc32c

        out["crc32c (crc32c)"] = crc32c.CRC32CHash
    except ImportError:
        skipped.append("crc32c")
    try:
        import google_crc32c

        # its C extension takes bytes only, not a memoryview of a tensor: one copy per
        # update in real use; "cached" hashes a ready bytes block (the hash alone),
        # "memory" slices a bytes object (the copy included, as in use)
        out["crc32c (google-crc32c, bytes only)"] = google_crc32c.Checksum
    except ImportError:
        skipped.append("google-crc32c")
    try:
        import blake3

        out["blake3 (blake3, 1 thread)"] = blake3.blake3
    except ImportError:
        skipped.append("blake3")
    return out, skipped


class _Running:
    """A running checksum function (``f(data, value) -> value``) as an ``update`` object."""

    def __init__(self, f: Callable[[object, int], int]) -> None:
        self.f, self.value = f, 0

    def update(self, data: object) -> None:
        self.value = self.f(data, self.value)


def _rate(factory: Callable[[], object], data: memoryview, reps: int, cached: bool) -> list:
    """GB/s of each rep."""
    rates = []
    n = len(data)
    block = data[:BLOCK]
    if getattr(factory, "__module__", "").startswith("google_crc32c"):
        block = bytes(block)  # see _candidates; the memory case slices the bytes object
        data = data.obj  # type: ignore[assignment]
    for _ in range(reps):
        h = factory()
        t0 = time.perf_counter()
        if cached:
            for _ in range(n // BLOCK):
                h.update(block)
        else:
            for i in range(0, n, BLOCK):
                h.update(data[i : i + BLOCK])
        rates.append(n / (time.perf_counter() - t0) / 1e9)
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    data = memoryview(os.urandom(args.mib << 20))  # .obj: the bytes, for google-crc32c
    cands, skipped = _candidates()
    load_start = os.getloadavg()
    rows = {}
    print(f"{args.mib} MiB, 256 KiB updates, best (median) of {args.reps}, GB/s on one core")
    print(f"  {'hash':28s} {'cached':>15s} {'memory':>15s}")
    for name, factory in cands.items():
        slow = "sha" in name or "md5" in name or "blake2" in name
        reps = max(2, args.reps // 3) if slow else args.reps
        c = _rate(factory, data, reps, cached=True)
        m = _rate(factory, data, reps, cached=False)
        rows[name] = {"cached": c, "memory": m}
        print(
            f"  {name:28s} {max(c):6.1f} ({statistics.median(c):5.1f})"
            f" {max(m):6.1f} ({statistics.median(m):5.1f})"
        )
    if skipped:
        print(f"  not installed, skipped: {', '.join(skipped)}")
    print(f"load average at the start: {load_start}, at the end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({
            "bench": "hashes", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "mib": args.mib, "gb_per_s": rows, "skipped": skipped,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
