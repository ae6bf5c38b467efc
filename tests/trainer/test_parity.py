"""Trainer + data parallelism equals one process on the same global batch.

Tolerances (``tests/tolerance.py``): every logged loss and the weights after 8 AdamW
steps (normwise over the model, each tensor within ``per_tensor``) within ``trajectory``
of the run's learning rates (1e-3 decaying linearly over 8 steps): the runs compute the
same sums in a different order (per-rank partial sums, then the all-reduce), which Adam's
normalised update carries into the weights. Not elementwise: Adam divides by sqrt(v),
which turns 1e-7 gradient differences in near-zero gradient entries into updates that
differ by a visible fraction of lr. The first logged loss against the model evaluated by
hand on the same rows: ``evaluation()``.

The data is padded causal-LM rows of 3..12 tokens, so micro-batches hold different
numbers of label tokens: only a loss normalised by the tokens of the whole accumulation
window over all ranks (meshtrain.trainer.loss) makes these runs equal.
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks
from tests.tolerance import check, check_weights, evaluation, trajectory
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


STEPS = 8  # 32 rows / 8 per step x 2 epochs
TOL = trajectory([1e-3 * (1 - step / STEPS) for step in range(STEPS)])  # linear decay


def _close(what, a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        check(f"{what} loss {step}", abs(x - y) / abs(x), TOL)


def test_dp_and_accumulation_equal_the_full_batch(tmp_path):
    ((full, accum, by_hand),) = run_ranks(_one_process, 1, str(tmp_path))
    (dp, dp_accum), _ = run_ranks(_two_processes, 2, str(tmp_path))
    assert len(full[0]) == STEPS
    check("first loss by hand", abs(full[0][0] - by_hand) / abs(by_hand), evaluation())
    for what, (losses, weights) in {"accum": accum, "dp": dp, "dp_accum": dp_accum}.items():
        _close(what, full[0], losses)
        check_weights(what, weights, full[1], TOL)
