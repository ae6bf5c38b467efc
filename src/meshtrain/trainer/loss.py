"""How a micro-batch's loss is weighted so that an optimizer step equals one big batch.

The math. An optimizer step sees ``k`` micro-batches on each of ``R`` data-parallel ranks;
micro-batch ``(i, r)`` has ``n_ir`` label items (tokens whose label is not -100, counted
after the shift for causal LMs; one per row for classification). The loss of the whole
step is ``sum_ir S_ir / N`` with ``S_ir`` the summed per-item loss and ``N = sum_ir n_ir``.
A model returns the *mean* ``L_ir = S_ir / n_ir``, so the Trainer hands the engine
``L_ir`` with its weight in the step's gradient (``Engine.backward(loss, weight=...)``,
the step's gradient then being ``sum_ir weight_ir x grad L_ir``)

    weight_ir = n_ir / N

which is exactly the gradient of ``sum_ir S_ir / N``; the engine's window turns the
weight into its one loss multiplier (``engine/window.py``), in place of DeepSpeed's
``1 / (k R)`` mean, so nothing is multiplied here only to be divided again there. ``N`` costs one all-reduce of one number per optimizer
step (the window's micro-batches are fetched before the first forward, as transformers
does). This holds for every model whose loss is a mean over its label items, whether or
not its ``forward`` accepts transformers' loss kwargs; padding, uneven tails and uneven
label counts across ranks all come out exact.

A loss that is already normalised by the whole window (``compute_loss_func``, or a
``compute_loss`` override when ``trainer.loss_is_scaled_for_ga`` is set) is the share
``S_ir / N`` and is handed over with weight 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from meshtrain.distributed import comm

IGNORE_INDEX = -100


def loss_shifts_labels(model: Any) -> bool:
    """True for causal LMs, whose loss predicts token t+1 from t (so the first label of a
    row is never a target): transformers ``*ForCausalLM`` / ``*LMHeadModel`` decoders and
    meshtrain's reference ``Decoder``."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    if getattr(model, "loss_type", None) == "ForCausalLM":
        return True
    name = type(model).__name__
    return name.endswith(("ForCausalLM", "LMHeadModel")) or name == "Decoder"


def batch_rows(batch: Any) -> int:
    """Rows in a batch (the first dimension of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, list | tuple) or isinstance(batch, Mapping):
        for v in values:
            n = batch_rows(v)
            if n:
                return n
    return 0


def label_items(batch: Any, label_names: list[str], shift: bool) -> int:
    """Label items of a micro-batch (see the module docstring); its rows when it has no
    integer labels (regression, a custom loss on unnamed targets)."""
    labels = batch.get(label_names[0]) if isinstance(batch, Mapping) and label_names else None
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        if shift and labels.dim() >= 2:
            labels = labels[..., 1:]
        return int(labels.ne(IGNORE_INDEX).sum())
    if isinstance(labels, torch.Tensor):
        return int(labels.numel())
    return batch_rows(batch)


def takes_argument(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts ``name`` as a keyword (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    if name in params:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def forward_names(model: Any) -> tuple[str, ...] | None:
    """Names ``model.forward`` accepts, in its signature's order (the Trainer's default
    ``label_names`` follow it, as transformers' ``find_labels`` does: a set's order changes
    with each process's string hashing); None when it takes ``**kwargs`` (anything goes)."""
    forward = getattr(model, "forward", model)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return tuple(params)


def window_items(
    window: list[Any], label_names: list[str], shift: bool, topology: Any, device: Any,
    *, across: bool = True,
) -> tuple[list[int], float, float]:  # fmt: skip
    """Label items per micro-batch of ``window``, their sum on this rank, and ``N``: the
    sum over every data-parallel rank (one all-reduce of one number). ``across=False``
    (``average_tokens_across_devices=False``) weighs each rank by its own items: ``N`` is
    this rank's count times the ranks, so each rank's mean counts ``1 / R``."""
    counts = [label_items(b, label_names, shift) for b in window]
    local_items = float(sum(counts))
    if not across:
        return counts, local_items, local_items * topology.dp_size
    total_items = local_items
    if topology.dp_size > 1:
        total = torch.tensor(local_items, device=device)
        comm.all_reduce(total, topology.dp_group, label="control")
        total_items = float(total)
    return counts, local_items, total_items


__all__ = [
    "IGNORE_INDEX",
    "batch_rows",
    "forward_names",
    "label_items",
    "loss_shifts_labels",
    "takes_argument",
    "window_items",
]
