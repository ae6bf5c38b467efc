"""Per-step numbers for the engine's log line and for callers (Trainer, ``meshtrain train``).

Every ``steps_per_print`` optimizer steps, rank 0 logs one line::

    step 20 | loss 5.8123 | lr 1.00e-03 | scale 65536 | grad norm 0.912 | 35.1 samples/s |
    1123 tokens/s | comm 29.5 MB

``loss`` is this rank's mean over the micro-batches of the step; samples and tokens are
counted from the batches seen (tokens = elements of ``input_ids`` when the batch has
them) and multiplied by the data-parallel size; throughput is over the wall time since
the previous step ended; ``comm`` is the bytes the step recorded (see
``meshtrain.distributed.comm`` for the convention).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

log = logging.getLogger("meshtrain")


def _batch_size_and_tokens(args: tuple, kwargs: dict) -> tuple[int, int]:
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        tokens = ids.numel() if not ids.is_floating_point() and ids.dim() >= 2 else 0
        return ids.shape[0], tokens
    return 0, 0


class StepLog:
    """Accumulates one optimizer step's loss, samples and tokens; logs every ``every``."""

    def __init__(self, engine: Any, every: int) -> None:
        self.engine = engine
        self.every = every
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._tokens = 0
        self._t0 = time.perf_counter()
        self.last: dict[str, float] = {}

    def count_batch(self, args: tuple, kwargs: dict) -> None:
        samples, tokens = _batch_size_and_tokens(args, kwargs)
        self._samples += samples
        self._tokens += tokens

    def add_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.float())

    def end_step(self) -> None:
        e = self.engine
        now = time.perf_counter()
        seconds = max(now - self._t0, 1e-9)
        dp = e.topology.dp_size
        loss = float(torch.stack(self._losses).mean()) if self._losses else float("nan")
        comm_bytes = e.last_step_comm_bytes()["total"]
        self.last = {
            "step": e.global_steps,
            "loss": loss,
            "lr": e.get_lr()[0],
            "loss_scale": e.loss_scale,
            "grad_norm": e.get_global_grad_norm() or float("nan"),
            "samples_per_s": self._samples * dp / seconds,
            "tokens_per_s": self._tokens * dp / seconds,
            "comm_bytes": comm_bytes,
            "skipped": e.last_step_skipped,
            "seconds": seconds,
        }
        self._losses.clear()
        self._samples = self._tokens = 0
        self._t0 = now
        if self.every and e.global_steps % self.every == 0 and e.topology.rank == 0:
            s = self.last
            log.info(
                "step %d | loss %.4f | lr %.2e | scale %g | grad norm %.3f | %.1f samples/s "
                "| %.0f tokens/s | comm %.1f MB%s",
                s["step"],
                s["loss"],
                s["lr"],
                s["loss_scale"],
                s["grad_norm"],
                s["samples_per_s"],
                s["tokens_per_s"],
                comm_bytes / 1e6,
                " | skipped (overflow)" if s["skipped"] else "",
            )
