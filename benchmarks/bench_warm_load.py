"""Where the time of a verified load from the page cache goes: the copy, the hash, a second
core, page faults, each measured on its own (issue 32's 5% goal, docs/checkpoints.md).

    python -m benchmarks.bench_warm_load [--mib 128] [--seconds 3] [--json OUT]

A file of ``--mib`` MiB of random bytes (8 keys) is written and read once, so it is in the
page cache; every load then reads it as ``checkpoint.rank_file`` does: ``readinto`` in
``BLOCK`` (256 KiB) pieces, each block hashed with xxh3-64 right after it lands when
verifying. Each case alternates unverified and verified loads (about ``--seconds`` of
each) and prints the medians and their ratio, over all loads and over the **undisturbed**
ones: those whose CPU time (the process's, all threads) was at least 0.9 x wall x the
cores the case uses. On a shared machine only those show what the hardware does; a load
that waited for a core adds the same wait to both variants and so pulls the ratio to 1.

* ``one core``: one thread; the time of the ``readinto`` calls (the kernel's copy out of
  the page cache) and of the ``update`` calls (the hash, the block in the cache) are
  summed apart, giving each one's rate;
* ``two threads``: the parallel reader the issue's follow-up asks about: each key split in
  halves, the second read (and hashed, when verifying) by a worker thread (``readinto``
  and xxhash's ``update`` of more than 64 KiB release the GIL); undisturbed: 1.8 cores;
* ``two processes``: the same halves in two processes (no GIL at all), load by load in
  lockstep; a pair's wall runs from the earlier start to the later end, and it counts as
  undisturbed when the two CPU times add up to 1.8 x that wall (they ran at once);
* ``hash map first`` (``... map per load``): verified loads hash each block from a memory
  map of the file before ``readinto`` copies it, so the hash reads the page cache from
  DRAM and the copy then reads it from the cache, with one map for every load (the
  most favourable case) or a map per load (a reader reads each key once);
* ``fresh storage``: each key into memory never touched before (an anonymous mapping, kept
  until the load ends, as a caller that holds the state dict gets from a fresh
  allocation) instead of a storage the allocator hands back freed: the cost of the page
  faults, counted (``ru_minflt``).

Everywhere else the storage is reused between loads (as when a caller drops each tensor
after copying it into its parameter, which is what ``bench_integrity`` measures; glibc
then hands back the freed block): such a load faults no page.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import platform
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import xxhash

from meshtrain.checkpoint.rank_file import BLOCK

NKEYS = 8
CASES = (
    "one core",
    "two threads",
    "two processes",
    "fresh storage",
    "hash map first",
    "... map per load",
)


def _read(fd: int, base: int, dst: memoryview, lo: int, hi: int, verify: bool) -> list[int]:
    """Bytes ``[lo, hi)`` of the key at file offset ``base`` into ``dst[lo:hi]``, block by
    block; returns [copy ns, hash ns]."""
    h = xxhash.xxh3_64() if verify else None
    spent = [0, 0]
    pos = lo
    while pos < hi:
        view = dst[pos : min(pos + BLOCK, hi)]
        t0 = time.perf_counter_ns()
        got = os.preadv(fd, [view], base + pos)
        t1 = time.perf_counter_ns()
        if h is not None:
            h.update(view if got == len(view) else view[:got])
            spent[1] += time.perf_counter_ns() - t1
        spent[0] += t1 - t0
        pos += got
    return spent


def _load(fd: int, key: int, dst: list[memoryview], verify: bool, part=(0, 1)) -> list[int]:
    """One load of every key (or of part ``i`` of ``n`` of every key): [wall, copy, hash,
    cpu, start] ns (cpu: the process's, all its threads; start: the monotonic clock, which
    is the same in every process)."""
    i, n = part
    t0, c0 = time.perf_counter_ns(), time.process_time_ns()
    spent = [0, 0]
    for k in range(NKEYS):
        c, h = _read(fd, k * key, dst[k % len(dst)], key * i // n, key * (i + 1) // n, verify)
        spent[0] += c
        spent[1] += h
    return [time.perf_counter_ns() - t0, *spent, time.process_time_ns() - c0, t0]


def _alternate(count: int, one_load, sync=None) -> dict[bool, list[list[int]]]:
    """``count`` unverified and ``count`` verified loads, alternating (each after
    ``sync.wait()``, when given: processes in lockstep)."""
    out: dict[bool, list[list[int]]] = {False: [], True: []}
    for j in range(2 * count):
        if sync is not None:
            sync.wait()
        out[j % 2 == 1].append(one_load(j % 2 == 1))
    return out


def _summary(runs: dict[bool, list[list[int]]], nbytes: int, cores: int = 1) -> dict:
    """Medians of the loads that ran undisturbed (CPU time >= 0.9 x wall x ``cores``: no
    other process took a core from them), and of all loads."""
    out: dict = {"loads": {str(v): len(runs[v]) for v in runs}}
    clean = {v: [r for r in runs[v] if r[3] >= 0.9 * r[0] * cores] for v in runs}
    out["undisturbed loads"] = {str(v): len(clean[v]) for v in runs}
    for label, sel in (("", clean), (" all", runs)):
        if not sel[False] or not sel[True]:
            continue
        med = {v: [statistics.median(r[j] for r in sel[v]) / 1e6 for j in range(3)] for v in sel}
        out["wall_ms" + label] = {"no verify": med[False][0], "verify": med[True][0]}
        out["ratio" + label] = med[True][0] / med[False][0]
        if label == "":
            out["copy_gb_s"] = nbytes / med[False][1] / 1e6 if med[False][1] else None
            out["hash_gb_s"] = nbytes / med[True][2] / 1e6 if med[True][2] else None
    return out


def _worker(path: str, key: int, i: int, barrier, count: int, q) -> None:
    fd = os.open(path, os.O_RDONLY)
    # written (so faulted in) before the clock starts; no torch op in a forked child: its
    # OpenMP pool does not survive fork
    dst = [memoryview(bytearray(b"\1") * key)]
    q.put((i, _alternate(count, lambda v: _load(fd, key, dst, v, (i, 2)), barrier)))


def _pair(a: list[int], b: list[int]) -> list[int]:
    """Two processes' loads of one step as one: from the earlier start to the later end
    (when they took turns on one core, that is both halves' time), and both CPU times."""
    wall = max(a[4] + a[0], b[4] + b[0]) - min(a[4], b[4])
    return [wall, max(a[1], b[1]), max(a[2], b[2]), a[3] + b[3], min(a[4], b[4])]


def _processes(path: str, key: int, nbytes: int, count: int) -> dict:
    """Both halves at once in two processes, load by load in lockstep; a pair's wall is
    the later one's, its CPU the sum (undisturbed: both near 1 core)."""
    ctx = multiprocessing.get_context("fork")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(path, key, i, barrier, count, q)) for i in (0, 1)]
    for p in procs:
        p.start()
    got = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    pairs = {v: [_pair(a, b) for a, b in zip(got[0][v], got[1][v], strict=True)] for v in got[0]}
    return _summary(pairs, nbytes, cores=2)


class _Half:
    """A worker thread that reads the second half of each key while the caller reads the first."""

    def __init__(self, fd: int, key: int, dst: memoryview) -> None:
        self.fd, self.key, self.dst = fd, key, dst
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.job: tuple[int, bool] | None = None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.go.acquire()
            if self.job is None:
                return
            k, verify = self.job
            _read(self.fd, k * self.key, self.dst, self.key // 2, self.key, verify)
            self.done.release()

    def load(self, verify: bool) -> list[int]:
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        for k in range(NKEYS):
            self.job = (k, verify)
            self.go.release()
            _read(self.fd, k * self.key, self.dst, 0, self.key // 2, verify)
            self.done.acquire()
        return [time.perf_counter_ns() - t0, 0, 0, time.process_time_ns() - c0]

    def stop(self) -> None:
        self.job = None
        self.go.release()


def _hash_first(fd: int, key: int, dst: memoryview, nbytes: int, count: int, kept: bool) -> dict:
    """Verified loads that hash each block from a memory map of the file (the page cache
    itself, from DRAM) *before* ``readinto`` copies it, so that the copy reads it from the
    cache: with one map ``kept`` for every load, or a map made per load (a reader reads
    each key once, so it would pay the map's page faults every time). Unverified: plain."""
    kept_map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) if kept else None
    if kept_map is not None:
        xxhash.xxh3_64_intdigest(kept_map)  # its page tables filled before the clock starts

    def one(verify: bool) -> list[int]:
        if not verify:
            return _load(fd, key, [dst], False)
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        m = kept_map if kept_map is not None else mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        src = memoryview(m)
        for k in range(NKEYS):
            h = xxhash.xxh3_64()
            for pos in range(0, key, BLOCK):
                h.update(src[k * key + pos : k * key + pos + BLOCK])
                os.preadv(fd, [dst[pos : pos + BLOCK]], k * key + pos)
        src.release()
        if kept_map is None:
            m.close()
        return [time.perf_counter_ns() - t0, 0, 0, time.process_time_ns() - c0]

    out = _summary(_alternate(count, one), nbytes)
    if kept_map is not None:
        kept_map.close()
    return out


def _fresh(fd: int, key: int, nbytes: int, count: int) -> dict:
    flt: dict[bool, list[int]] = {False: [], True: []}

    def one(verify: bool) -> list[int]:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        # anonymous mappings: pages the process never touched, as a fresh allocation has
        # (glibc's malloc may instead hand back freed heap memory, already faulted in)
        held = [mmap.mmap(-1, key) for _ in range(NKEYS)]
        r = _load(fd, key, [memoryview(m) for m in held], verify)
        flt[verify].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        for m in held:
            m.close()
        return r

    out = _summary(_alternate(count, one), nbytes)
    out["page faults per load"] = statistics.median(flt[False] + flt[True])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    key = args.mib * (1 << 20) // NKEYS
    nbytes = key * NKEYS
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "keys.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(nbytes))
        fd = os.open(path, os.O_RDONLY)
        buf = torch.ones(key, dtype=torch.uint8)
        dst = [memoryview(buf.numpy())]
        _load(fd, key, dst, False)  # in the page cache
        one = _alternate(3, lambda v: _load(fd, key, dst, v))
        count = max(10, int(args.seconds / 2 / statistics.median(r[0] / 1e9 for r in one[True])))
        res["one core"] = _summary(_alternate(count, lambda v: _load(fd, key, dst, v)), nbytes)
        half = _Half(fd, key, dst[0])
        res["two threads"] = _summary(_alternate(count, half.load), nbytes, cores=2)
        half.stop()
        res["two processes"] = _processes(path, key, nbytes, count)
        res["fresh storage"] = _fresh(fd, key, nbytes, max(5, count // 10))
        res["hash map first"] = _hash_first(fd, key, dst[0], nbytes, count, kept=True)
        res["... map per load"] = _hash_first(fd, key, dst[0], nbytes, count // 4, kept=False)
        os.close(fd)
    block = bytearray(os.urandom(BLOCK))
    h, t0 = xxhash.xxh3_64(), time.perf_counter_ns()
    for _ in range(2048):
        h.update(block)
    res["xxh3 in cache GB/s"] = 2048 * BLOCK / (time.perf_counter_ns() - t0)
    copy = res["one core"]["copy_gb_s"]
    res["hash GB/s needed for 5%"] = copy / 0.05
    print(f"{nbytes / 2**20:.0f} MiB from the page cache, {NKEYS} keys, {BLOCK >> 10} KiB blocks")
    for name in CASES:
        r = res[name]
        n = r["undisturbed loads"]
        line = f"  {name:14s} undisturbed {n['False']:4d}/{n['True']:<4d}"
        for label in ("", " all"):
            if "wall_ms" + label in r:
                w = r["wall_ms" + label]
                line += (f" |{label or ' undisturbed'}: {w['no verify']:6.2f} / {w['verify']:6.2f} ms"
                         f" {r['ratio' + label]:.3f}x")  # fmt: skip
        if "page faults per load" in r:
            line += f" | {r['page faults per load']:.0f} page faults per load"
        print(line)
    print(f"  copy (one core) {copy:.1f} GB/s; hash right after it {res['one core']['hash_gb_s']:.1f}"
          f" GB/s; xxh3 on a cached block {res['xxh3 in cache GB/s']:.1f} GB/s;"
          f" 5% would need {res['hash GB/s needed for 5%']:.0f} GB/s")  # fmt: skip
    res.update(loadavg_start=load_start, loadavg_end=os.getloadavg())
    print(f"load average at the start: {load_start}, at the end: {res['loadavg_end']}")
    if args.json:
        res.update(bench="warm_load", date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   machine=platform.platform(), cpus=os.cpu_count(), mib=args.mib)  # fmt: skip
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
