"""At scale: prepare a generated 1M-row JSONL, reuse it, and read it from 4 ranks whose
memory does not grow with the dataset.

The seeds' failure: 1M tokenized samples held in every process (140 GB each), so an
8-GPU machine could run only 6. Here the 1M-row store's ``tokens.bin`` is ~140 MB, more
than the 64 MB bound, so a reader that loaded it (or its offsets) into each process would
fail the RSS test; memory-mapped readers only touch the pages of the rows they read.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random

import pytest

from meshtrain.data import ByteTokenizer, TokenStore, prepare

N_ROWS = 1_000_000
EMPTY_EVERY = 100_000
BASE = (
    "great hotel, clean room, friendly staff; 房间干净, 服务热情; would stay again and again!! " * 2
)
RSS_BOUND_MB = 64


def row_text(i: int) -> str:
    start = (i * 7) % 40
    return f"{i:07d} " + BASE[start : start + 40 + i % 23]


def generate(path: str, n: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for lo in range(0, n, 50_000):
            lines = []
            for i in range(lo, min(n, lo + 50_000)):
                text = "" if i % EMPTY_EVERY == 99 else row_text(i)
                lines.append(f'{{"text": "{text}"}}\n')
            f.write("".join(lines))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    big_src, small_src = str(root / "big.jsonl"), str(root / "small.jsonl")
    generate(big_src, N_ROWS)
    generate(small_src, 10_000)
    big = prepare(big_src, "byte", root / "big", workers=2, progress=False)
    small = prepare(small_src, "byte", root / "small", workers=2, progress=False)
    return big_src, big, small


def test_prepare_one_million_rows(stores):
    big_src, big, _ = stores
    n_empty = N_ROWS // EMPTY_EVERY
    assert (big.rows_read, big.skipped_empty, big.skipped_bad, big.docs) == (
        N_ROWS,
        n_empty,
        0,
        N_ROWS - n_empty,
    )
    kept = [i for i in range(N_ROWS) if i % EMPTY_EVERY != 99]
    assert big.tokens == sum(len(row_text(i).encode()) + 2 for i in kept)
    store = TokenStore(big.out)
    tok = ByteTokenizer()
    for doc in random.Random(0).sample(range(len(kept)), 200):
        assert tok.decode(store.doc(doc)) == row_text(kept[doc])
    # the second run reads the input only to hash it: no tokenizing, files untouched
    stamp = os.stat(os.path.join(big.out, "tokens.bin")).st_mtime_ns
    again = prepare(big_src, "byte", big.out, workers=2, progress=False)
    assert again.reused and again.tokens == big.tokens
    assert os.stat(os.path.join(big.out, "tokens.bin")).st_mtime_ns == stamp


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) // 1024  # MB
    return out


def _read_as_rank(path: str, rank: int, world: int, batches: int, batch_size: int, queue) -> None:
    """One data-parallel rank: sampler + dataset + collator over random batches."""
    import torch

    from meshtrain.data import CausalLMCollator, DistributedSampler, TokenDataset

    collate = CausalLMCollator(pad_token_id=256)
    collate([{"input_ids": torch.arange(64)}] * batch_size)  # warm the allocator first
    before = _status()
    dataset = TokenDataset(path)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=rank)
    order = iter(sampler)
    checksum = 0
    for _ in range(batches):
        batch = collate(dataset.__getitems__([next(order) for _ in range(batch_size)]))
        checksum += int(batch["input_ids"].sum())
    after = _status()
    queue.put(
        (
            rank,
            {
                "rss": after["VmRSS"] - before["VmRSS"],
                "hwm": after["VmHWM"] - before["VmRSS"],
                "anon": after["RssAnon"] - before["RssAnon"],
                "checksum": checksum,
            },
        )
    )


def _four_ranks(path: str) -> dict[int, dict[str, int]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_read_as_rank, args=(path, r, 4, 60, 32, queue)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_four_ranks_memory_does_not_grow_with_the_dataset(stores):
    _, big, small = stores
    tokens_mb = os.path.getsize(os.path.join(big.out, "tokens.bin")) >> 20
    assert tokens_mb > 2 * RSS_BOUND_MB, "loading the data into a process would break the bound"
    growth_big = _four_ranks(big.out)
    growth_small = _four_ranks(small.out)
    for rank in range(4):
        b, s = growth_big[rank], growth_small[rank]
        msg = f"rank {rank}: 1M-row store {b} MB vs 10k-row store {s} MB"
        assert b["hwm"] - s["hwm"] <= RSS_BOUND_MB, msg
        assert b["rss"] - s["rss"] <= RSS_BOUND_MB, msg
        assert b["anon"] - s["anon"] <= RSS_BOUND_MB, msg
        assert b["checksum"] > 0
