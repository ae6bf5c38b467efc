"""Trainer + data parallelism equals one process on the same global batch.

Tolerance 1e-6 on every logged loss (fp32, no dropout): the runs compute the same sums
in a different order (per-rank partial sums, then the all-reduce), ~1e-7 relative. The
weights after 8 AdamW steps agree within 1e-5: Adam divides by sqrt(v), which turns
1e-7 gradient differences in near-zero gradient entries into slightly larger ones.

The data is padded causal-LM rows of 3..12 tokens, so micro-batches hold different
numbers of label tokens: only a loss normalised by the tokens of the whole accumulation
window over all ranks (meshtrain.trainer.loss) makes these runs equal.
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks
from tests.trainer.common import TINY, lm_rows, pad_collate, train_lm


def _one_process(tmp: str):
    from meshtrain.models import Decoder

    full = train_lm(f"{tmp}/a", per_device=8, accumulation=1)
    accum = train_lm(f"{tmp}/d", per_device=2, accumulation=4)
    # the first step's loss by hand: mean over every label token of the first global batch
    from meshtrain.data.sampler import DistributedSampler

    rows = lm_rows()
    sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=42)
    first = pad_collate([rows[i] for i in sampler.indices()[:8]])
    with torch.no_grad():
        by_hand = float(Decoder(TINY)(**first))
    return full, accum, by_hand


def _two_processes(tmp: str):
    dp = train_lm(f"{tmp}/b", per_device=4, accumulation=1)
    dp_accum = train_lm(f"{tmp}/c", per_device=2, accumulation=2)
    return dp, dp_accum


def _close(a, b, tol):
    assert len(a) == len(b)
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= tol, worst


def test_dp_and_accumulation_equal_the_full_batch(tmp_path):
    ((full, accum, by_hand),) = run_ranks(_one_process, 1, str(tmp_path))
    (dp, dp_accum), _ = run_ranks(_two_processes, 2, str(tmp_path))
    assert len(full[0]) == 8  # 32 rows / 8 per step x 2 epochs
    assert abs(full[0][0] - by_hand) <= 1e-6
    for losses, weights in (accum, dp, dp_accum):
        _close(full[0], losses, 1e-6)
        for k, v in weights.items():
            assert torch.allclose(full[1][k], v, atol=1e-5, rtol=0), k
