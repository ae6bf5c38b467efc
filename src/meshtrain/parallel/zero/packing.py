"""How a FlatGroup's parameters are packed into buckets of ``P`` equal chunks.

Pure arithmetic over parameter sizes (no tensors), so it is tested without processes.
``pack_buckets`` lays parameters end to end (element-wise and blockwise optimizers, which
take any cut); ``pack_whole`` keeps each parameter inside one rank's chunk (optimizers that
need whole parameters).
"""

from __future__ import annotations


def pack_buckets(
    numels: list[int],
    bucket_numel: int,
    partitions: int,
    keys: list | None = None,
    align: int = 1,
) -> list[tuple[int, int, list[int]]]:
    """Greedy packing: ``[(start, padded_numel, [param indices]), ...]`` in order.

    ``align > 1``: each parameter takes a multiple of ``align`` elements and a bucket a
    multiple of ``partitions x align``, so every parameter starts, and every rank's chunk
    starts, on the ``align`` grid (``Layout``)."""
    out: list[tuple[int, int, list[int]]] = []
    numels = [-(-n // align) * align for n in numels]
    partitions = partitions * align
    start, cur, members = 0, 0, []
    for i, n in enumerate(numels):
        new_key = keys is not None and members and keys[i] != keys[members[-1]]
        if members and (cur + n > bucket_numel or new_key):
            padded = -(-cur // partitions) * partitions
            out.append((start, padded, members))
            start, cur, members = start + padded, 0, []
        members.append(i)
        cur += n
    if members:
        padded = -(-cur // partitions) * partitions
        out.append((start, padded, members))
    return out


def pack_whole(
    numels: list[int], bucket_numel: int, partitions: int, keys: list | None = None
) -> list[tuple[int, int, list[int], list[int]]]:
    """Packing for optimizers that need each parameter whole on one rank (the ``"whole"``
    master layout: Adafactor factors a matrix's rows and columns and scales by its RMS).

    ``[(start, padded_numel, [param indices], [their flat offsets]), ...]``. Each bucket is
    still ``P`` equal chunks (so it reduce-scatters and all-gathers like any other), but
    every parameter lies inside one chunk: in order, each goes to the least-filled chunk,
    and a bucket closes when its largest chunk would pass ``bucket_numel / P`` (a larger
    parameter gets a bucket of its own). ``chunk`` is the largest chunk's fill; the others
    are zero-padded to it, which is the memory this layout costs over ``"flat"``: at most
    one parameter's size per rank per bucket. With ``P = 1`` it is the flat packing."""
    out: list[tuple[int, int, list[int], list[int]]] = []
    cap = max(1, -(-bucket_numel // partitions))
    start, members, bins = 0, [], [[] for _ in range(partitions)]

    def close() -> None:
        nonlocal start, members, bins
        chunk = max(sum(numels[i] for i in b) for b in bins)
        offsets = {}
        for r, b in enumerate(bins):
            at = start + r * chunk
            for i in b:
                offsets[i] = at
                at += numels[i]
        out.append((start, chunk * partitions, members, [offsets[i] for i in members]))
        start += chunk * partitions
        members, bins = [], [[] for _ in range(partitions)]

    for i, n in enumerate(numels):
        new_key = keys is not None and members and keys[i] != keys[members[-1]]
        if members:
            least = min(sum(numels[j] for j in b) for b in bins)
            if new_key or least + n > cap:
                close()
        target = min(bins, key=lambda b: sum(numels[j] for j in b))
        target.append(i)
        members.append(i)
    if members:
        close()
    return out


def padding_spans(
    start: int, numel: int, offsets: list[int], sizes: list[int]
) -> list[tuple[int, int]]:
    """``[lo, hi)`` flat ranges of a bucket ``[start, start + numel)`` that no parameter
    (at ``offsets``, of ``sizes``) covers: alignment gaps, the other chunks' fill under
    ``pack_whole``, and the tail padding to a multiple of ``P``."""
    spans, end = [], start
    for off, n in sorted(zip(offsets, sizes, strict=True)):
        if off > end:
            spans.append((end, off))
        end = max(end, off + n)
    if start + numel > end:
        spans.append((end, start + numel))
    return spans


__all__ = ["pack_buckets", "pack_whole", "padding_spans"]
