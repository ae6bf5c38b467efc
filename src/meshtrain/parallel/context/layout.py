"""The context-parallel sequence layout: which tokens of a sequence each cp rank holds.

A sequence of length ``L`` (``L`` divisible by ``2C`` for a cp group of ``C`` ranks) is
cut into ``2C`` equal chunks of ``c = L / 2C`` tokens; cp rank ``i`` holds chunks ``i`` and
``2C - 1 - i``, concatenated (local length ``L / C``)::

    C = 2, L = 8:  chunks   0 1 | 2 3 | 4 5 | 6 7     (c = 2)
                   rank 0 holds chunks 0 and 3: tokens 0 1 6 7
                   rank 1 holds chunks 1 and 2: tokens 2 3 4 5

Why this layout (causal load balancing): under a causal mask the token at position ``p``
attends to ``p + 1`` keys, so a plain contiguous split gives the last rank ``2C - 1`` times
the work of the first. Pairing an early chunk with its mirror makes every rank's share of
the causal triangle equal: ``(i + 1/2) c + (2C - i - 1/2) c = 2C c`` key-query pairs per
token row of the pair, whatever ``i``. Every cp tensor (``q``/``k``/``v`` handed to
``context.attend``, ``document_ids``, the attention output, ``input_ids``, ``labels``,
``position_ids``) uses this layout; it is the contract shared by the ring and the
all-to-all (Ulysses) algorithms. Pure arithmetic: no process group needed.
"""

from __future__ import annotations

import torch

from meshtrain.errors import ConfigError


def chunk_size(length: int, cp_size: int) -> int:
    """``L / 2C``; ConfigError naming the length when it does not divide."""
    if length % (2 * cp_size):
        raise ConfigError(
            f"context parallelism: sequence length {length} is not divisible by 2 x cp = "
            f"{2 * cp_size}; pad the rows to a multiple of {2 * cp_size} (the engine pads "
            "input_ids/labels/position_ids itself, with -100 labels)"
        )
    return length // (2 * cp_size)


def local_indices(length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global token positions held by ``cp_rank``, in local order: ``[L / C]``."""
    c = chunk_size(length, cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange(
        (2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device
    )
    return torch.cat((first, second))


def shard(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's chunks of ``x`` along ``dim`` (the sequence dimension)."""
    if cp_size == 1:
        return x
    c = chunk_size(x.shape[dim], cp_size)
    first = x.narrow(dim, cp_rank * c, c)
    second = x.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)
    return torch.cat((first, second), dim=dim)


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every rank's local tensor (``parts[i]``: rank i's)."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    c = parts[0].shape[dim] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for i, part in enumerate(parts):
        chunks[i] = part.narrow(dim, 0, c)
        chunks[2 * cp_size - 1 - i] = part.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


__all__ = ["chunk_size", "local_indices", "shard", "unshard"]
