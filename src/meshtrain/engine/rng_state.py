"""The random-number streams a checkpoint carries per rank (python, numpy, torch, CUDA):
captured at save, restored at load only when the world size matches (a rank's stream has
no meaning under another layout)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    py = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]], "numpy": [kind, pos, has_gauss, cached]}
    tensors = {
        "rng.torch": torch.get_rng_state(),
        "rng.numpy": torch.from_numpy(keys.astype(np.int64)),
    }
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return state, tensors


def set_rng(state: dict, reader, rank: int) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, pos, has_gauss, cached = state["numpy"]
    keys = reader.rank_tensor(rank, "rng.numpy").numpy().astype(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    torch.set_rng_state(reader.rank_tensor(rank, "rng.torch"))
    if torch.cuda.is_available() and "rng.cuda" in reader.rank_keys(rank):
        torch.cuda.set_rng_state(reader.rank_tensor(rank, "rng.cuda"))
