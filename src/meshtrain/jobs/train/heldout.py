"""The held-out loss of ``meshtrain train``: token-weighted, over every data-parallel rank,
in an order that does not depend on how many ranks there are.

Batches are fixed by the data alone: batch ``j`` is held-out rows ``[jB, (j+1)B)`` (``B`` =
``train_micro_batch_size_per_gpu``, the last batch shorter), whatever the world size.
Data-parallel rank ``r`` of ``R`` evaluates batches ``r, r + R, ...``; the ranks of one
tensor-parallel group (one dp coordinate) evaluate the same batches together. Each batch
gives the pair

    S_j = sum of next-token cross-entropy over its labelled positions (nats),
    N_j = number of those positions (labels shifted by one, -100 left out),

``S_j`` from the model's own loss with ``num_items_in_batch=1`` (a sum in fp32; under
tensor parallelism the vocab-parallel loss). One ``all_gather`` over the dp group gives
every rank every batch's pair as float64, and every rank sums them in batch order::

    loss = (S_0 + S_1 + ... ) / (N_0 + N_1 + ...),    perplexity = exp(loss)

so it is a mean over tokens, not over batches or rows (a packed row's padded tail
weighs nothing). Why this shape: ``S_j`` is a function of batch ``j``'s rows and the
weights only, and the final sum runs over the same numbers in the same order for any
``R``. An evaluation on ``R`` ranks therefore equals one on one process bit for bit, as
long as a batch's forward gives the same bits on both (same rows, weights, kernels and
intra-op threads): true for data parallelism under every ZeRO stage
(``tests/jobs_train/test_main_job.py`` checks it), not under tensor parallelism, whose
forward is itself split over ranks (fp32 rounding: 8e-8 measured at tp 2).

Every rank runs the same number of forwards, ``ceil(n_batches / R)``: a rank with fewer
batches runs batch 0 again and drops it, because under ZeRO-3 (parameter gathers) and
expert parallelism (token all-to-all) a forward is a collective. The evaluation runs
under ``torch.no_grad`` in eval mode and puts back what it touched: the training mode,
a MoE model's ``aux_in_forward`` (the load-balancing loss is no part of the held-out loss)
and its experts' ``tokens_seen`` (the counts the next step's bias update reads).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from meshtrain.distributed import comm


class HeldOut:
    """The held-out rows, their collator and the batch size; :meth:`evaluate` runs it."""

    def __init__(self, dataset: Any, collate: Callable, batch_size: int) -> None:
        self.dataset = dataset
        self.collate = collate
        self.batch_size = int(batch_size)
        self.rows = len(dataset)
        self.n_batches = math.ceil(self.rows / self.batch_size)

    def batch(self, j: int) -> dict[str, torch.Tensor]:
        """Batch ``j``: rows ``[jB, (j+1)B)``."""
        end = min(self.rows, (j + 1) * self.batch_size)
        return self.collate([self.dataset[i] for i in range(j * self.batch_size, end)])

    def evaluate(
        self, module: torch.nn.Module, group: comm.Group | None, device: torch.device
    ) -> dict[str, float]:
        """``{"loss", "perplexity", "tokens", "rows", "runtime"}``, the same on every rank
        of ``group`` (the data-parallel group; None: one process). Every rank of the
        group must call it."""
        t0 = time.perf_counter()
        ranks, rank = (1, 0) if group is None else (group.size, group.rank)
        mine = list(range(rank, self.n_batches, ranks))
        forwards = math.ceil(self.n_batches / ranks)
        table = torch.zeros(forwards, 2, dtype=torch.float64, device=device)
        saved = _take_over(module)
        try:
            with torch.no_grad():
                for slot in range(forwards):
                    j = mine[slot] if slot < len(mine) else 0  # a dropped, matching forward
                    summed, count = _batch_loss(module, self.batch(j), device)
                    if slot < len(mine):
                        table[slot, 0], table[slot, 1] = summed, count
        finally:
            _give_back(module, saved)
        if ranks > 1:
            everyone = torch.empty(ranks * forwards * 2, dtype=torch.float64, device=device)
            comm.all_gather(everyone, table.reshape(-1), group, label="control")
            everyone = everyone.view(ranks, forwards, 2)
        else:
            everyone = table.view(1, forwards, 2)
        pairs = everyone.cpu().tolist()
        total, tokens = 0.0, 0.0
        for j in range(self.n_batches):  # batch order: the same sum for any rank count
            summed, count = pairs[j % ranks][j // ranks]
            total += summed
            tokens += count
        loss = total / tokens if tokens else float("nan")
        return {
            "loss": loss,
            "perplexity": math.exp(loss) if tokens else float("nan"),
            "tokens": int(tokens),
            "rows": self.rows,
            "runtime": round(time.perf_counter() - t0, 4),
        }


def _batch_loss(module, batch: dict[str, torch.Tensor], device) -> tuple[float, int]:
    """(summed cross-entropy in nats, labelled positions) of one batch."""
    batch = {k: v.to(device) for k, v in batch.items()}
    labels = batch["labels"]
    count = int((labels[:, 1:] != -100).sum())  # the model shifts labels by one
    summed = module(**batch, num_items_in_batch=1)
    return float(summed), count


def _take_over(module: torch.nn.Module) -> dict[str, Any]:
    """Put ``module`` in evaluation state; returns what :func:`_give_back` restores
    (module docstring)."""
    saved = {
        "training": module.training,
        "aux": getattr(module, "aux_in_forward", None),
        "seen": [(m, m.tokens_seen) for m in module.modules() if hasattr(m, "tokens_seen")],
    }
    module.eval()
    if saved["aux"] is not None:
        module.aux_in_forward = False
    return saved


def _give_back(module: torch.nn.Module, saved: dict[str, Any]) -> None:
    module.train(saved["training"])
    if saved["aux"] is not None:
        module.aux_in_forward = saved["aux"]
    for m, seen in saved["seen"]:
        m.tokens_seen = seen


__all__ = ["HeldOut"]
