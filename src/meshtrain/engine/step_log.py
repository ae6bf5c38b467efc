"""Per-step numbers for the engine's log line and for callers (Trainer, ``meshtrain train``).

Every ``steps_per_print`` optimizer steps, rank 0 prints one line (on stdout through the
``meshtrain`` logger, like DeepSpeed, with no logging set-up needed)::

    step 20 | loss 5.8123 | lr 1.00e-03 | scale 65536 | grad norm 0.912 | 35.1 samples/s |
    1123 tokens/s | comm 29.5 MB

and, with ``wall_clock_breakdown: true``, ``| forward 12.1 ms | backward 25.3 ms | step
4.0 ms`` (summed over the step's micro-batches; on CUDA the device is synchronised around
each phase, which costs a little overlap). ``loss`` is this rank's mean over the
micro-batches of the step; samples and tokens are counted from the batches seen (tokens
= elements of ``input_ids`` when the batch has them) and multiplied by the data-parallel
size; throughput is over the wall time since the previous step ended; ``comm`` is the
bytes the step recorded (see ``meshtrain.distributed.comm`` for the convention).

A mixture-of-experts model adds ``| tokens/expert 12-40 | all-to-all 1.2 MB``: the fewest
and most tokens any expert of any layer received in the step's global batch, and the
bytes of the step's token all-to-alls (``meshtrain.parallel.experts.load``); ``last``
holds them as ``tokens_per_expert_min``, ``tokens_per_expert_max``, ``all_to_all_bytes``.

MFU (``mfu`` in ``last``, ``| MFU x%`` in the line) appears once the engine called
``set_mfu`` (see ``meshtrain.engine.flops``): model FLOPs per token x tokens/s over all
ranks / (peak FLOP/s per device x data-parallel size). The peak is a data-sheet figure for
known GPUs and a measured matmul peak elsewhere; ``mfu_peak_source`` says which. With it
``flops`` in ``last`` is the step's model FLOPs, per token x the step's tokens over all
ranks (the Trainer sums them into ``total_flos``).

Activation memory (``activation_bytes`` in ``last``, ``| act x MB/rank`` in the line)
appears once ``set_activations`` was called (``meshtrain.estimate.activations.
attach_activations``): the formula's bytes per rank for the last micro-batch's rows and
this rank's tokens per row (``L/C`` under context parallelism), an estimate, not a
measurement.

A rank that made the others wait (stopped, swapping, slowed by a neighbour) gets a line
of its own on the step it happened, whatever ``steps_per_print`` says::

    step 4: straggler: waited 5.6 s in reduce_scatter #33 on the dp group for rank 1
    (node 1, 10.213.0.2), which had not entered it after 2.0 s

(``meshtrain.distributed.stragglers``; ``stragglers`` in ``last``). Rank 0 logs it; another
rank logs a wait for rank 0.

Silence or redirect the lines with the standard logging API, e.g.
``logging.getLogger("meshtrain").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from meshtrain.distributed.stragglers import describe

log = logging.getLogger("meshtrain")
PHASES = ("forward", "backward", "step")


def ensure_visible(logger: logging.Logger = log) -> None:
    """Give the ``meshtrain`` logger a stdout handler at INFO unless the program set up
    logging itself (a handler on it or on the root logger), so step lines show by default."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[meshtrain] %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _batch_size_and_tokens(args: tuple, kwargs: dict) -> tuple[int, int]:
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        tokens = ids.numel() if not ids.is_floating_point() and ids.dim() >= 2 else 0
        return ids.shape[0], tokens
    return 0, 0


class StepLog:
    """Accumulates one optimizer step's loss, samples, tokens (and phase times); the
    engine hands it the step's facts in ``end_step``; it logs every ``every`` steps."""

    def __init__(
        self,
        every: int,
        dp_size: int,
        is_logging_rank: bool,
        breakdown: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.every = every
        self.dp_size = dp_size
        self.is_logging_rank = is_logging_rank
        self.breakdown = breakdown
        self._sync = breakdown and device is not None and device.type == "cuda"
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._tokens = 0
        self._phase = dict.fromkeys(PHASES, 0.0)
        self._t0 = time.perf_counter()
        self.last: dict[str, Any] = {}
        self._dense = self._per_seq = self._peak = 0.0
        self._seq = 0
        self._peak_source = ""
        self._activations = None  # (micro-batch rows, tokens per row) -> bytes per rank
        self._rows = 0
        if every and is_logging_rank:
            ensure_visible()

    def set_mfu(self, dense: float, per_seq: float, peak_flops: float, source: str) -> None:
        """Report MFU from now on: a token costs ``dense + per_seq x T`` FLOPs at sequence
        length ``T`` (``6 N`` and ``12 L d``); ``peak_flops`` is per device, ``source``
        says where it comes from."""
        self._dense, self._per_seq = dense, per_seq
        self._peak, self._peak_source = peak_flops, source

    def set_activations(self, estimate) -> None:
        """Report activation memory per rank from now on: ``estimate(rows, tokens)`` is
        the bytes for one micro-batch of ``rows`` rows of ``tokens`` tokens on this rank."""
        self._activations = estimate

    def mfu(self, tokens_per_s: float) -> tuple[float, str] | None:
        """(MFU at ``tokens_per_s`` over all ranks, the peak's source), or None when the
        model's FLOPs or the sequence length are unknown."""
        if not (self._peak and self._seq):
            return None
        achieved = (self._dense + self._per_seq * self._seq) * tokens_per_s
        return achieved / (self._peak * self.dp_size), self._peak_source

    def restart_clock(self) -> None:
        """Measure the next step from now: time spent since the last step on something
        else (an evaluation) is not the step's."""
        self._t0 = time.perf_counter()

    def count_batch(self, args: tuple, kwargs: dict) -> None:
        samples, tokens = _batch_size_and_tokens(args, kwargs)
        if tokens and samples:
            self._seq = tokens // samples
            self._rows = samples
        self._samples += samples
        self._tokens += tokens

    def add_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.float())

    def timed(self, phase: str):
        """Time ``phase`` into this step's breakdown (a no-op unless enabled)."""
        return self._timed(phase) if self.breakdown else nullcontext()

    @contextmanager
    def _timed(self, phase: str):
        if self._sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self._phase[phase] += time.perf_counter() - t0

    def end_step(
        self,
        *,
        step: int,
        lr: float,
        loss_scale: float,
        grad_norm: float | None,
        comm_bytes: int,
        skipped: bool,
        moe: dict[str, int] | None = None,
        stragglers: list[dict] | None = None,
    ) -> dict[str, Any]:
        """Record the facts of optimizer step ``step`` (1-based); returns ``last``."""
        now = time.perf_counter()
        seconds = max(now - self._t0, 1e-9)
        loss = float(torch.stack(self._losses).mean()) if self._losses else float("nan")
        self.last = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "loss_scale": loss_scale,
            "grad_norm": float("nan") if grad_norm is None else grad_norm,
            "samples_per_s": self._samples * self.dp_size / seconds,
            "tokens_per_s": self._tokens * self.dp_size / seconds,
            "comm_bytes": comm_bytes,
            "skipped": skipped,
            "seconds": seconds,
            **(moe or {}),
        }
        mfu = self.mfu(self.last["tokens_per_s"]) if self._tokens else None
        if mfu is not None:
            self.last["mfu"], self.last["mfu_peak_source"] = mfu
            # the step's model FLOPs over all ranks, MFU's numerator (transformers' total_flos)
            per_token = self._dense + self._per_seq * self._seq
            self.last["flops"] = per_token * self._tokens * self.dp_size
        if self._activations is not None and self._rows and self._seq:
            self.last["activation_bytes"] = self._activations(self._rows, self._seq)
        if self.breakdown:
            self.last.update({f"{k}_ms": v * 1e3 for k, v in self._phase.items()})
            self._phase = dict.fromkeys(PHASES, 0.0)
        self._losses.clear()
        self._samples = self._tokens = 0
        self._t0 = now
        if stragglers:
            self.last["stragglers"] = stragglers
            for event in stragglers:
                # rank 0 logs; another rank only a wait for rank 0, which cannot see it
                if self.is_logging_rank or any(r["rank"] == 0 for r in event["late"]):
                    log.warning(describe(step, event))
        if self.every and step % self.every == 0 and self.is_logging_rank:
            log.info(self.format(self.last))
        return self.last

    def format(self, s: dict[str, Any]) -> str:
        """The step line for the facts ``s`` (see the module docstring)."""
        line = (
            f"step {s['step']} | loss {s['loss']:.4f} | lr {s['lr']:.2e} | "
            f"scale {s['loss_scale']:g} | grad norm {s['grad_norm']:.3f} | "
            f"{s['samples_per_s']:.1f} samples/s | {s['tokens_per_s']:.0f} tokens/s | "
            f"comm {s['comm_bytes'] / 1e6:.1f} MB"
        )
        if "activation_bytes" in s:
            line += f" | act {s['activation_bytes'] / 1e6:.1f} MB/rank"
        if "mfu" in s:
            line += f" | MFU {100 * s['mfu']:.1f}%"
        if "tokens_per_expert_min" in s:
            line += (
                f" | tokens/expert {s['tokens_per_expert_min']}-{s['tokens_per_expert_max']}"
                f" | all-to-all {s['all_to_all_bytes'] / 1e6:.1f} MB"
            )
        if self.breakdown:
            line += "".join(f" | {k} {s[f'{k}_ms']:.1f} ms" for k in PHASES)
        return line + (" | skipped (non-finite gradients)" if s["skipped"] else "")
