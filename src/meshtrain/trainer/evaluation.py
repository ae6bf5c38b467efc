"""Evaluation and prediction over every data-parallel rank, returning exactly the
dataset's rows in dataset order.

Rank ``r`` of ``R`` takes whole batches of ``B = per_device_eval_batch_size`` rows in
dataset order, batches ``r, r + R, r + 2R, ...``, as the transformers Trainer's eval
loader (accelerate's ``BatchSamplerShard`` over a ``SequentialSampler``) does, so a
collator pads or masks the same rows together and a batch's mean loss is over the same
rows. Unlike it, the last global batch is not padded with the first rows (nothing is
duplicated, so no batch's loss includes repeated rows: ranks differ by at most ``B``
rows; when ``n`` is a multiple of ``R B`` the two are the same). Under ZeRO-3 the forward
gathers parameters with collectives, so a rank that runs out of batches repeats its
first one (row 0 of the dataset when it had no rows) and discards the result until every
rank has run the same number of forwards.
Under pipeline parallelism the forwards run through the pipeline and the last stage's
outputs are broadcast over the pp group (``trainer.pipeline_step``), so every rank of a
replica holds the same per-batch results. Predictions stay on the CPU as numpy arrays; batches of different sequence lengths are
padded with -100 to a common shape (as transformers does). At the end one
``all_gather_object`` over the data-parallel group brings every rank's arrays to every
rank, and each rank's rows go back to their dataset positions (``rank_rows``).

``eval_loss`` is the mean of the per-batch losses weighted by their rows (each row is
counted once over all ranks).

Under tensor parallelism the ranks of a tensor-parallel group evaluate the same rows; a
decoder's LM head gives each of the ``T`` ranks ``ceil(V / T)`` logits of the (padded)
vocabulary, so ``vocab_gatherer`` all-gathers them along the last dimension (``B x S x
V_padded`` values per batch) and drops the padding: predictions are over the whole
vocabulary, as on one process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from meshtrain.data.sampler import exact_rows_order
from meshtrain.models.kv_cache import is_kv_cache
from meshtrain.trainer.loss import batch_rows
from meshtrain.trainer.state import EvalPrediction, PredictionOutput

PAD = -100


def to_numpy(x: Any) -> Any:
    """Tensors (nested in tuples/lists/dicts) -> CPU numpy; float16/bfloat16 -> float32."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.is_floating_point() and x.dtype != torch.float64:
            x = x.float()
        return x.cpu().numpy()
    if isinstance(x, list | tuple):
        return type(x)(to_numpy(v) for v in x)
    if isinstance(x, dict):
        return {k: to_numpy(v) for k, v in x.items()}
    return x


def pad_concat(arrays: list[np.ndarray], pad: int = PAD) -> np.ndarray:
    """Concatenate along rows, padding the other dimensions to the largest with ``pad``."""
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        return np.zeros((0,))
    if all(a.shape[1:] == arrays[0].shape[1:] for a in arrays):
        return np.concatenate(arrays, axis=0)
    tail = tuple(max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim))
    out = np.full((sum(a.shape[0] for a in arrays), *tail), pad, dtype=arrays[0].dtype)
    row = 0
    for a in arrays:
        out[(slice(row, row + a.shape[0]), *(slice(0, s) for s in a.shape[1:]))] = a
        row += a.shape[0]
    return out


def nested_concat(parts: list[Any]) -> Any:
    """``pad_concat`` applied leaf by leaf to a list of same-structured (tuples of) arrays."""
    if not parts:
        return None
    first = parts[0]
    if isinstance(first, list | tuple):
        return type(first)(nested_concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: nested_concat([p[k] for p in parts]) for k in first}
    return pad_concat(parts)


def nested_rows(x: Any, n: int) -> Any:
    """The first ``n`` rows of every leaf."""
    if isinstance(x, list | tuple):
        return type(x)(nested_rows(v, n) for v in x)
    if isinstance(x, dict):
        return {k: nested_rows(v, n) for k, v in x.items()}
    return x[:n]


def interleave(per_rank: list[Any], total: int, rows: list[list[int]] | None = None) -> Any:
    """The ``total`` dataset rows in dataset order from each rank's part: ``per_rank[r]``
    holds dataset rows ``rows[r]`` (``rank_rows``, the evaluation's dealing); without
    ``rows``, rows ``r, r + R, ...`` (round-robin, the sampler's undealing rule)."""
    first = next((p for p in per_rank if p is not None), None)
    if first is None:
        return None
    if isinstance(first, list | tuple):  # a rank without rows (fewer rows than ranks): None
        return type(first)(
            interleave([None if p is None else p[i] for p in per_rank], total, rows)
            for i in range(len(first))
        )
    if isinstance(first, dict):
        return {
            k: interleave([None if p is None else p[k] for p in per_rank], total, rows)
            for k in first
        }
    empty = np.zeros((0, *np.shape(first)[1:]), dtype=np.asarray(first).dtype)
    per_rank = [empty if p is None else p for p in per_rank]
    # one common shape over ranks (sequence lengths may differ between ranks)
    padded = pad_concat(per_rank)
    if rows is None:
        return padded[exact_rows_order([len(part) for part in per_rank], 0, total)]
    where = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows] or [np.zeros(0, np.int64)])
    return padded[np.argsort(where, kind="stable")]


def rank_rows(n: int, ranks: int, rank: int, batch_size: int) -> list[int]:
    """Dataset rows rank ``rank`` evaluates: batches ``rank, rank + ranks, ...`` of
    ``batch_size`` rows in dataset order (module docstring)."""
    b = max(1, int(batch_size))
    batches = range(rank, math.ceil(n / b), ranks)
    return [i for k in batches for i in range(k * b, min(n, (k + 1) * b))]


def max_batches(n: int, ranks: int, batch_size: int) -> int:
    """Forwards every rank runs under ZeRO-3 (the most any rank needs)."""
    return math.ceil(math.ceil(n / batch_size) / ranks) if n else 0


class PredictionHooks(NamedTuple):
    """What ``prediction_loop`` asks of the Trainer: ``steps(loader, loss_only,
    ignore_keys)`` yields ``(batch, loss, logits, labels)``; ``on_step()`` runs after each
    batch; ``pad_forward(batch)`` is a forward whose result is dropped (ZeRO-3)."""

    steps: Callable[..., Any]
    on_step: Callable[[], None]
    pad_forward: Callable[[Any], None]


def eval_loader(dataset: Any, args: Any, topo: Any, collate: Any):
    """The rows this data-parallel rank evaluates (``rank_rows``), in batches."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=args.per_device_eval_batch_size,
        sampler=rank_rows(
            len(dataset), topo.dp_size, topo.dp_rank, args.per_device_eval_batch_size
        ),
        collate_fn=collate,
        num_workers=args.dataloader_num_workers,
    )


def prediction_loop(trainer, dataset: Any, ignore_keys: list[str] | None, prefix: str, hooks):
    """Evaluate or predict ``dataset`` (already column-filtered) on every data-parallel
    rank (module docstring); returns a ``PredictionOutput`` with ``<prefix>_`` metrics,
    identical on every rank. ``hooks``: the Trainer's ``steps(loader, loss_only,
    ignore_keys)`` iterator of ``(batch, loss, logits, labels)``, ``on_step()`` after each
    batch and ``pad_forward(batch)`` (a ZeRO-3 forward whose result is dropped); the
    Trainer's public members are read, none of its private ones."""
    import torch.distributed as dist

    args, topo = trainer.args, trainer.engine.topology
    n, ranks = len(dataset), topo.dp_size
    loader = eval_loader(dataset, args, topo, trainer.data_collator)
    loss_only = args.prediction_loss_only
    include = getattr(args, "include_for_metrics", [])
    main_input = getattr(trainer.model, "main_input_name", "input_ids")
    preds, labels, loss_sum, seen, had_loss = [], [], 0.0, 0, False
    inputs, losses = [], []  # include_for_metrics: the batch's main input, each row's loss
    t0 = time.perf_counter()
    trainer.model.eval()
    batches = 0
    first = None
    steps = hooks.steps(loader, loss_only, ignore_keys)
    for batch, loss, logits, lab in steps:
        first = first if first is not None else batch
        size = batch_rows(batch)
        batches += 1
        if loss is not None:
            loss_sum += float(loss) * size
            had_loss = True
        if logits is not None and trainer.preprocess_logits_for_metrics is not None:
            logits = trainer.preprocess_logits_for_metrics(logits, lab)
        if logits is not None:
            preds.append(to_numpy(logits))
        if lab is not None:
            labels.append(to_numpy(lab))
        if "inputs" in include and isinstance(batch, Mapping) and main_input in batch:
            inputs.append(to_numpy(batch[main_input]))
        if "loss" in include and loss is not None:  # transformers: loss.repeat(batch_size)
            losses.append(np.full((size,), float(loss), dtype=np.float32))
        seen += size
        hooks.on_step()
    if getattr(trainer.engine.zero, "gatherer", None) is not None and n:
        if first is None:  # fewer rows than ranks: this rank had none; any row will do
            first = trainer.data_collator([dataset[0]])
        for _ in range(max_batches(n, ranks, args.per_device_eval_batch_size) - batches):
            with torch.no_grad():  # ZeRO-3: match the other ranks' collectives
                hooks.pad_forward(first)
    mine = (
        loss_sum, seen, had_loss, nested_concat(preds), nested_concat(labels),
        nested_concat(inputs), nested_concat(losses),
    )  # fmt: skip
    if ranks > 1:
        everyone: list[Any] = [None] * ranks
        dist.all_gather_object(everyone, mine, group=topo.dp_group.pg)
    else:
        everyone = [mine]
    total_loss = sum(e[0] for e in everyone)
    counted = sum(e[1] for e in everyone)
    # from every rank's parts: a rank may have had no rows (fewer rows than ranks)
    rows = [rank_rows(n, ranks, r, args.per_device_eval_batch_size) for r in range(ranks)]
    predictions = interleave([e[3] for e in everyone], n, rows)
    label_ids = interleave([e[4] for e in everyone], n, rows)
    runtime = time.perf_counter() - t0
    metrics: dict[str, float] = {}
    if trainer.compute_metrics is not None and predictions is not None and label_ids is not None:
        extra = {
            "inputs": interleave([e[5] for e in everyone], n, rows)
            if "inputs" in include
            else None,
            "losses": interleave([e[6] for e in everyone], n, rows) if "loss" in include else None,
        }
        metrics.update(trainer.compute_metrics(EvalPrediction(predictions, label_ids, **extra)))
    metrics = {k: plain(v) for k, v in metrics.items()}
    if counted and any(e[2] for e in everyone):
        metrics["loss"] = total_loss / counted
    metrics.update(
        runtime=round(runtime, 4),
        samples_per_second=round(n / runtime, 3),
        steps_per_second=round(
            math.ceil(n / max(1, ranks) / args.per_device_eval_batch_size) / runtime, 3
        ),
    )
    metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in metrics.items()}
    return PredictionOutput(predictions, label_ids, metrics)


def vocab_gatherer(engine, model) -> Any:
    """Under tensor parallelism with a vocab-parallel LM head: a function turning a
    model's outputs' sharded ``logits`` into full-vocabulary logits (module docstring);
    otherwise None."""
    topo = engine.topology
    if topo.tp_size == 1:
        return None
    import operator

    from meshtrain.parallel.tensor.mappings import gather_from_region
    from meshtrain.parallel.tensor.plans import TPPlan, plan_for

    custom = getattr(getattr(engine.config, "tensor_parallel", None), "plan", None)
    plan = TPPlan.from_dict(custom) if custom else plan_for(model)
    if plan is None or "vocab" not in plan.sizes or all(r[1] != "lm_head" for r in plan.rows):
        return None  # e.g. BERT classification: its logits are whole on every rank
    vocab = int(operator.attrgetter(plan.sizes["vocab"])(model))
    local = -(-vocab // topo.tp_size)

    def full(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] == local:
            return gather_from_region(x.contiguous(), topo.tp_group, dim=-1)[..., :vocab]
        return x

    def gather(outputs: Any) -> Any:
        if isinstance(outputs, Mapping) and "logits" in outputs:
            outputs["logits"] = full(outputs["logits"])
            return outputs
        return full(outputs) if isinstance(outputs, torch.Tensor) else outputs

    return gather


def plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return value


def logits_of(outputs: Any, ignore_keys: list[str]) -> Any:
    """The prediction part of a model's outputs (transformers: everything but the loss).

    A key/value cache is never a prediction: it is dropped by what it is, whatever the
    output field is called in this transformers release (``models/kv_cache.py``)."""
    if isinstance(outputs, Mapping):
        items = tuple(
            v
            for k, v in outputs.items()
            if k != "loss" and k not in ignore_keys and not is_kv_cache(v)
        )
    elif isinstance(outputs, tuple | list):
        items = tuple(outputs[1:]) if len(outputs) > 1 else tuple(outputs)
    elif isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return None  # a model that returns only its loss (meshtrain's Decoder) predicts nothing
    else:
        return outputs
    items = tuple(v for v in items if v is not None)
    if not items:
        return None
    return items[0] if len(items) == 1 else items


__all__ = [
    "interleave",
    "logits_of",
    "prediction_loop",
    "max_batches",
    "nested_concat",
    "nested_rows",
    "pad_concat",
    "rank_rows",
    "to_numpy",
]
