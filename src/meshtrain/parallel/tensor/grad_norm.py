"""The global gradient norm when tensor parallelism shards some parameters.

Over a ``tp x dp`` mesh the model's gradient is the concatenation of every tensor-parallel
shard of the sharded parameters plus ONE copy of the replicated ones (norms, row biases,
everything no plan names), which all ``T`` tensor-parallel ranks hold identically. So

    ||g||^2 = sum_tp( ||g_sharded,r||^2 ) + ||g_replicated||^2
            = sum_tp( ||g_sharded,r||^2 + ||g_replicated||^2 / T )

and each rank contributes its sharded squares plus ``1/T`` of its replicated squares to a
sum over the tensor-parallel group (one scalar all-reduce, recorded under ``control``),
then over the data-parallel group where ZeRO shards the gradients. Padding (zero heads,
vocabulary rows) adds nothing.

The ranges are found once: for each flat group, bucket by bucket, the spans of this rank's
owned chunk that belong to sharded parameters and those that do not (padding between
buckets is zero either way). Each span's norm is taken in fp32 (``vector_norm``) and the
squares are summed in fp64, so the replicated part is never a difference of two sums.
"""

from __future__ import annotations

import torch

Spans = list[list[list[tuple[int, int]]]]  # [group][bucket] -> [(lo, hi)] in the chunk


def sharded_spans(flat_groups, sharded_ids: set[int]) -> tuple[Spans, Spans]:
    """Chunk-local ``[lo, hi)`` spans of tensor-parallel-sharded parameters, and the
    complementary spans (replicated parameters and padding)."""
    out: Spans = []
    rest: Spans = []
    for g in flat_groups:
        per_bucket = []
        for b in g.buckets:
            lo, hi = g.owned_range(b)
            spans = []
            for p, off in zip(b.params, b.offsets, strict=True):
                if id(p) not in sharded_ids:
                    continue
                a, z = off - b.start, off - b.start + g.shapes[p].numel()
                a, z = max(a, lo), min(z, hi)
                if a < z:
                    spans.append((a - lo, z - lo))
            per_bucket.append(spans)
        out.append(per_bucket)
        rest.append(
            [_complement(sp, g.owned_range(b)) for sp, b in zip(per_bucket, g.buckets, strict=True)]
        )
    return out, rest


def _complement(spans: list[tuple[int, int]], owned: tuple[int, int]) -> list[tuple[int, int]]:
    size, pos, out = owned[1] - owned[0], 0, []
    for a, z in spans:
        if a > pos:
            out.append((pos, a))
        pos = z
    if pos < size:
        out.append((pos, size))
    return out


def local_square_sum(chunks, spans: tuple[Spans, Spans], tp: int, device) -> torch.Tensor:
    """This rank's share of ``||g||^2`` (see the module docstring), fp64. ``chunks``: per
    flat group, this rank's gradient chunk of each bucket (ZeRO hands them over: the
    buffers are its own)."""
    sharded_spans_, rest_spans = spans
    parts, weights = [], []
    for group_chunks, sh, rest in zip(chunks, sharded_spans_, rest_spans, strict=True):
        for chunk, s_spans, r_spans in zip(group_chunks, sh, rest, strict=True):
            for spans_, w in ((s_spans, 1.0), (r_spans, 1.0 / tp)):
                for a, z in spans_:
                    parts.append(torch.linalg.vector_norm(chunk[a:z], dtype=torch.float32))
                    weights.append(w)
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack(parts).double()
    return (norms.pow(2) * torch.tensor(weights, dtype=torch.float64, device=device)).sum()


__all__ = ["local_square_sum", "sharded_spans"]
