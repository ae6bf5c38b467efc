"""``engine.train_batch`` / ``engine.eval_batch``: one optimizer step (or one evaluation)
over a window of micro-batches pulled from a data iterator, at any mesh.

Without a pipeline a window is the usual loop, micro-batch by micro-batch: forward,
``engine.backward`` (the window driver, ``engine.window``), ``engine.step``. With one the
pipeline supplies only its schedule (``parallel.pipeline.engine_step.run_window``: every
forward and backward of the window interleaved, through the same window driver), and the
Engine steps once after it. Either way the returned loss is the mean over the window's
micro-batches and over the data-parallel replicas (each pulled its own micro-batches):
one scalar all-reduce over dp (``control``) per call.

A micro-batch is the model's keyword arguments (a dict), its positional ones (a tuple or
list) or its one argument (anything else): the pipeline's rule, so the same iterator
feeds both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from meshtrain.distributed import comm
from meshtrain.parallel.pipeline.engine_step import run_eval_window, run_window


def loss_of(out: Any) -> torch.Tensor:
    """The loss in a model's output (a transformers ``ModelOutput``'s ``.loss``)."""
    return out.loss if hasattr(out, "loss") else out


def forward(engine, batch: Any) -> Any:
    """``engine(...)`` on one micro-batch by the module docstring's rule (``engine(...)``
    itself passes its arguments through untouched, as DeepSpeed's does)."""
    if isinstance(batch, dict):
        return engine(**batch)
    if isinstance(batch, list | tuple):
        return engine(*batch)
    return engine(batch)


def dp_mean(engine, loss: torch.Tensor) -> torch.Tensor:
    """The loss averaged over data-parallel replicas (each ran its own micro-batches)."""
    dp = engine.topology.dp_group
    if dp.size > 1:
        loss = loss.clone()
        comm.all_reduce(loss, dp, label="control")
        loss /= dp.size
    return loss


def train_batch(engine, data_iter: Iterator | None = None) -> torch.Tensor:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the
    mean loss on every rank (module docstring)."""
    batches = engine.micro_batches(data_iter, engine.gas)
    if engine.pipeline is None:
        losses = []
        for batch in batches:
            loss = loss_of(forward(engine, batch))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return dp_mean(engine, torch.stack(losses).mean())
    loss = run_window(engine, batches)
    engine.log.add_loss(loss)
    engine.step()
    return dp_mean(engine, loss)


@torch.no_grad()
def eval_batch(engine, data_iter: Iterator | None = None, num_micro_batches: int | None = None):
    """Mean loss over ``num_micro_batches`` (default gradient_accumulation_steps)
    micro-batches of any shapes, on every rank; no gradients, parameters unchanged."""
    batches = engine.micro_batches(data_iter, num_micro_batches or engine.gas)
    if engine.pipeline is not None:
        return dp_mean(engine, run_eval_window(engine, batches))
    was = engine.module.training
    engine.module.eval()
    try:
        return torch.stack([loss_of(forward(engine, b)).detach().float() for b in batches]).mean()
    finally:
        engine.module.train(was)


__all__ = ["dp_mean", "eval_batch", "forward", "loss_of", "train_batch"]
