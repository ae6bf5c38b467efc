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
owned chunk that belong to sharded parameters.
"""

from __future__ import annotations

import torch

Spans = list[list[list[tuple[int, int]]]]  # [group][bucket] -> [(lo, hi)] in the chunk


def sharded_spans(flat_groups, sharded_ids: set[int]) -> Spans:
    """Chunk-local ``[lo, hi)`` spans of tensor-parallel-sharded parameters."""
    out: Spans = []
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
    return out


def local_square_sum(flat_groups, spans: Spans, tp: int, device) -> torch.Tensor:
    """This rank's share of ``||g||^2`` (see the module docstring), fp32."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g, per_bucket in zip(flat_groups, spans, strict=True):
        for chunk, bucket_spans in zip(g.grad_chunks, per_bucket, strict=True):
            c = chunk.float()
            sq = c.pow(2).sum()
            sharded = sum((c[a:z].pow(2).sum() for a, z in bucket_spans), torch.zeros_like(sq))
            total += sharded + (sq - sharded) / tp
    return total


__all__ = ["local_square_sum", "sharded_spans"]
