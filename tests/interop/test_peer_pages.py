"""``peer_pickles.release_pages``: dropping the pages under a view of a mapped peer file
keeps its bytes readable (they fault in again from the page cache) and shrinks what this
process holds resident. Exact: the bytes are the file's either way."""

from __future__ import annotations

import os

import torch

from meshtrain.interop.peer_pickles import load_peer_file, release_pages


def _resident_kib() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_released_pages_read_back_the_same(tmp_path):
    saved = {"state": {0: {"exp_avg": torch.arange(4 << 20, dtype=torch.float32)}}}
    torch.save(saved, tmp_path / "optimizer.bin")
    t = load_peer_file(tmp_path / "optimizer.bin", "test")["state"][0]["exp_avg"]
    view = t[1000 : 3 << 20]
    first = view.clone()
    linux = os.path.exists("/proc/self/status")
    before = _resident_kib() if linux else 0
    release_pages(view)
    if linux:
        assert _resident_kib() < before - 8 * 1024  # 12 MiB of the view left this process
    assert torch.equal(view, first)  # faulted in again from the file
    assert torch.equal(t, saved["state"][0]["exp_avg"])
