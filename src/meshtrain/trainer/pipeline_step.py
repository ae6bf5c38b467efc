"""The Trainer under pipeline parallelism (``mesh={"pipeline_parallel_size": p}``).

The engine splits the user's transformers model into ``p`` stages (``parallel.pipeline.
split``: BERT, Llama, GPT-2 and their classifiers; the last stage computes the model's
own loss) and frees the storage of the blocks other ranks run. Every rank of a pp group
reads the same batches (the loader deals rows by data-parallel rank only).

Training step: the window's ``k`` micro-batches (``gradient_accumulation_steps``, fewer at
the end of an epoch) run through ``pipeline.schedule`` in one call. Micro-batch ``i`` of
replica ``r`` has ``n_ir`` label items; instead of the runtime's fixed ``1 / k`` its loss
``L_ir`` (the model's mean over its items) is weighted by ``w_ir = n_ir R / N`` with ``N``
the window's items over all ``R`` replicas (one all-reduce of one number, as without
pp): the gradient, averaged over replicas, is that of ``sum_ir n_ir L_ir / N``, the loss
of one process on the whole window (``trainer.loss``). The factor ``R`` is there because
the runtime's weights replace its ``1 / k`` inside each replica's mean, and the
replicas' gradients are still averaged after the schedule: ``w_ir / R = n_ir / N`` is the
weight in the step's gradient that ``Engine.backward(loss, weight=)`` takes without pp.
(Handing the runtime that weight directly needs ``parallel.pipeline.engine_step.
run_window`` and the window's ``schedule`` to take it, as ``backward`` does.) The runtime returns ``sum_i w_ir
L_ir`` on every rank of the replica; divided by ``R`` it is the replica's share of the
step's loss, which the Trainer logs and averages exactly as without pp. Callbacks: the
micro-batches interleave in the schedule, so the window's ``on_substep_end`` events fire
after it, before ``on_pre_optimizer_step``.

Evaluation / prediction: groups of ``EVAL_GROUP * p`` batches run through the forward
schedule (``PipelineRuntime.eval_outputs``), the last stage returning the model's whole
outputs; it takes the loss and the logits (``logits_of``, as ``prediction_step``) and
broadcasts them over the pp group without pickling: per group the results' spec (the
structure, shapes and dtypes as int64, ``parallel.pipeline.pytree``: its length, 8
bytes, then ``8 L`` bytes), then one broadcast per tensor, i.e. ``4 + rows x
logits-per-row x itemsize`` bytes per batch sent to each of the ``p - 1`` other ranks (a
BERT classifier with 3 labels: 4 + 12 x rows bytes; a causal LM: ``rows x seq x vocab x
4``). Every rank
then holds the same per-batch results and ``evaluation.prediction_loop`` gathers rows
over the data-parallel group as without pp (exact rows on uneven tails).

The end of training (``restore_user_model``): each pp rank's stages hold the trained
tensors of their blocks (the stages share the user's modules); the parameters of the
other ranks' blocks were freed by the split. One ``all_gather_object`` of the names (and
shapes) each rank holds and lacks, then every tensor goes once, point to point, from its
owner (the lowest pp rank holding it) to each pp rank that lacks it: rank ``r`` receives
``sum`` of the bytes of the user model's state-dict tensors its stages do not hold and
sends each tensor it owns once per rank lacking it (at pp 2: each rank receives the other
stage's bytes; a tied embedding both stages hold moves not at all). Recorded as
``pp_restore_send`` / ``pp_restore_recv``. ``engine.module_state_dict()`` (what
``save_model`` gathers) broadcasts every tensor instead, the whole model on every rank.
The received tensors replace the freed ones, so ``model`` runs whole on every rank
(``pipeline(...)``, ``generate``). Checkpoints are the engine's (sharded by stage,
resharding).

The user's loss (``compute_loss`` or ``prediction_step`` overridden, ``compute_loss_func``,
label names other than ``labels``): the stages get each batch without the label columns
the model's forward does not take; the last stage returns the model's whole outputs and,
per micro-batch, the Trainer's ``compute_loss(model, inputs, ...)`` runs there with the
whole batch as ``inputs`` and ``model`` a ``StageOutputs`` (calling it returns those
outputs). Its loss is the schedule's loss for that micro-batch: weighted by its label
items as above, or, with ``compute_loss_func`` (a loss already divided by the window's
items), by the replica count alone. In evaluation the Trainer's ``prediction_step`` runs
the same way on the last stage, and its ``(loss, logits, labels)`` is what is broadcast.
Tensor x pipeline parallelism is refused by ``TrainingArguments``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from meshtrain.errors import TrainingError
from meshtrain.models.kv_cache import CACHE_NAMES
from meshtrain.trainer.evaluation import logits_of
from meshtrain.trainer.inputs import move_to_device
from meshtrain.trainer.stage_outputs import StageOutputs

EVAL_GROUP = 4  # batches per pp rank in one evaluation call: bubble (p-1)/(4p+p-1) <= 0.2

__all__ = ["EVAL_GROUP", "PipelineSteps", "prediction_steps", "restore_user_model", "user_loss"]


def user_loss(cls: type, base: type, compute_loss_func: Any, label_names: list[str]) -> bool:
    """Whether the loss or the predictions are the user's, not the model's own: the
    Trainer subclass ``cls`` overrides ``compute_loss`` / ``prediction_step`` of ``base``,
    a ``compute_loss_func`` is given, or the labels are not named ``labels``. Under a
    pipeline they then run per micro-batch on the last stage (module docstring)."""
    overridden = any(
        getattr(cls, n) is not getattr(base, n) for n in ("compute_loss", "prediction_step")
    )
    return overridden or compute_loss_func is not None or list(label_names) != ["labels"]


class PipelineSteps:
    """What the Trainer's loop calls under pipeline parallelism: ``train_window`` (one
    optimizer step's forwards and backwards through the schedule), ``prediction_steps``
    (evaluation through the forward schedule) and ``restore_user_model`` (the end of
    training). It holds the engine, the user's model and the label names, never the
    Trainer; with the user's loss (module docstring) also the Trainer's
    ``compute_loss`` caller ``(model, inputs, return_outputs, num_items)``, its
    ``prediction_step`` and ``loss_is_share()``; ``gather_vocab``: under tp with a
    vocab-parallel head, what makes the last stage's logits whole for the user's loss."""

    def __init__(
        self,
        engine,
        model: nn.Module,
        label_names: list[str],
        compute_loss=None,
        prediction_step=None,
        loss_is_share=None,
        forward_names: tuple[str, ...] | None = None,
        gather_vocab=None,
    ) -> None:
        self.engine = engine
        self.gather_vocab = gather_vocab  # pp x tp: vocab-shard logits -> whole (or None)
        self.model = model
        self.label_names = list(label_names)
        self.compute_loss, self.prediction_step = compute_loss, prediction_step
        self.loss_is_share = loss_is_share
        self.forward_names = forward_names

    def stage_inputs(self, batch: Any) -> Any:
        """What the stages run on: ``batch`` without the label columns the model's
        forward does not take (the user's loss reads them from the whole batch)."""
        if self.compute_loss is None or not isinstance(batch, Mapping):
            return batch
        names = self.forward_names
        if names is None:
            return batch
        return {k: v for k, v in batch.items() if k not in self.label_names or k in names}

    def _user_loss(self, batches: list[Any], total_items: float):
        """The last stage's ``loss_fn(outputs, i)``: the Trainer's ``compute_loss`` on
        micro-batch ``i`` with ``model`` returning ``outputs``."""
        num = torch.tensor(total_items, device=self.engine.device)

        gather = self.gather_vocab  # pp x tp: an override sees whole-vocabulary logits too

        def loss_fn(outputs: Any, i: int) -> torch.Tensor:
            outputs = outputs if gather is None else gather(outputs)
            got = self.compute_loss(StageOutputs(self.model, outputs), batches[i], False, num)
            return got[0] if isinstance(got, tuple | list) else got

        return loss_fn

    def train_window(self, batches: list[Any], counts: list[int], total_items: float):
        """Forwards and backwards of ``batches`` (on the engine's device) through the
        schedule, weighted as the module docstring says; returns this replica's step loss
        x its data-parallel size (``sum_i w_i L_i``), as ``Trainer.training_step``'s
        shares sum to. The optimizer step is the caller's."""
        from meshtrain.parallel.pipeline.engine_step import run_window

        engine = self.engine
        replicas = engine.topology.dp_size
        weights = [n * replicas / total_items if total_items else 0.0 for n in counts]
        loss_fn = None
        if self.compute_loss is not None:
            loss_fn = self._user_loss(batches, total_items)
            if self.loss_is_share():  # already S_i / N: weight 1, R in the replica's mean
                weights = [float(replicas)] * len(batches)
            batches = [self.stage_inputs(b) for b in batches]
        weighted = run_window(engine, batches, weights, loss_fn)  # sum_i w_i L_i, every rank
        share = weighted.detach().float().to(engine.device)
        local_items = float(sum(counts))
        local_mean = float(share) * total_items / replicas / local_items if local_items else 0.0
        engine.log.add_loss(torch.tensor(local_mean))
        return share

    def prediction_steps(self, loader, loss_only: bool, ignore_keys: list[str] | None):
        return prediction_steps(self, loader, loss_only, ignore_keys)

    def restore_user_model(self) -> None:
        restore_user_model(self.engine, self.model)


def _loss_and_logits(steps, outputs: Any, inputs: Any, loss_only: bool, keys: list[str]):
    """What ``Trainer.prediction_step`` takes from a whole model's ``outputs``."""
    loss = None
    if _has_labels(steps.label_names, inputs):
        if isinstance(outputs, Mapping) and outputs.get("loss") is not None:
            loss = outputs["loss"]
        elif isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
            loss = outputs
        elif isinstance(outputs, tuple | list):
            loss = outputs[0]
        else:
            raise TrainingError(
                f"the last pipeline stage of {type(steps.model).__name__} returned no "
                "loss for a batch with labels; give the model labels it accepts"
            )
        loss = loss.detach().float().mean()
    logits = None if loss_only else logits_of(outputs, keys)
    return loss, logits


def _has_labels(label_names: list[str], inputs: Any) -> bool:
    return isinstance(inputs, Mapping) and all(inputs.get(n) is not None for n in label_names)


def prediction_steps(
    steps: PipelineSteps, loader, loss_only: bool, ignore_keys: list[str] | None
) -> Iterator[tuple[Any, Any, Any, Any]]:
    """``(batch, loss, logits, labels)`` per batch of ``loader``, the same on every rank
    of the pp group (module docstring)."""
    if ignore_keys is None:  # as Trainer.prediction_step
        config = getattr(steps.model, "config", None)
        ignore_keys = getattr(config, "keys_to_ignore_at_inference", list(CACHE_NAMES))
    engine = steps.engine
    pipe, topo = engine.pipeline, engine.topology
    batches = iter(loader)
    while group := list(itertools.islice(batches, EVAL_GROUP * topo.pp_size)):
        inputs = [move_to_device(b, engine.device, engine.dtype) for b in group]
        outs = pipe.eval_outputs([steps.stage_inputs(x) for x in inputs])
        mine = None
        if outs is not None and steps.prediction_step is not None:  # the user's, per batch
            mine = [
                tuple(
                    steps.prediction_step(StageOutputs(steps.model, o), x, loss_only, ignore_keys)
                )
                for o, x in zip(outs, inputs, strict=True)
            ]
        elif outs is not None:  # the last stage
            mine = [
                _loss_and_logits(steps, o, x, loss_only, ignore_keys)
                for o, x in zip(outs, inputs, strict=True)
            ]
        results = _from_last_stage(mine, pipe, engine.device)
        for batch, x, got in zip(group, inputs, results, strict=True):
            loss, logits = got[0], got[1]
            labels = got[2] if len(got) > 2 else None
            if len(got) == 2 and _has_labels(steps.label_names, x):
                found = tuple(x[n] for n in steps.label_names)
                labels = found[0] if len(found) == 1 else found
            yield batch, loss, logits, labels


def _from_last_stage(mine: list | None, pipe, device: torch.device) -> list:
    """The last stage's ``mine`` (a list of tensors / None / tuples, dicts of them) on
    every rank of the pp group: its spec's length and the spec as int64, then one
    broadcast per tensor (module docstring); nothing is pickled."""
    from meshtrain.distributed import comm
    from meshtrain.parallel.pipeline import pytree

    group = pipe.group
    if group.size == 1:
        return mine
    src = pipe.rank_of(pipe.num_stages - 1)  # rank 0 under the V schedules
    if mine is not None:
        spec = torch.tensor(pytree.encode(mine), dtype=torch.int64, device=device)
        length = torch.tensor([spec.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.empty(1, dtype=torch.int64, device=device)
    comm.broadcast(length, src=src, group=group, label="pp_eval")
    if mine is None:
        spec = torch.empty(int(length), dtype=torch.int64, device=device)
    comm.broadcast(spec, src=src, group=group, label="pp_eval")
    tree = pytree.decode(tuple(spec.tolist()))
    if mine is not None:
        tensors = [t.detach().contiguous() for t in pytree.leaves(mine, "evaluation result")]
    else:  # allocate what the spec describes, in its order
        tensors = [
            torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
            for leaf in pytree.spec_leaves(tree)
        ]
    for t in tensors:
        comm.broadcast(t, src=src, group=group, label="pp_eval")
    return pytree.unflatten(tree, tensors)


RESTORE_TAG = 1 << 16  # apart from the pipeline's own channels (tags 4 s + k, ``p2p``)


def restore_user_model(engine, model: nn.Module) -> None:
    """Put the trained tensors of the stages other pp ranks ran back into the user's model
    (module docstring): each tensor goes once from its owner (the lowest pp rank holding
    it) to each pp rank that lacks it. Collective over the pp group; the bytes are in the
    comm stats (``pp_restore_send`` / ``pp_restore_recv``)."""
    import torch.distributed as dist

    from meshtrain.distributed import comm

    group = engine.pipeline.group
    user: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (first state-dict key, tensor)
    for key, t in model.state_dict(keep_vars=True).items():
        user.setdefault(id(t), (key, t))
    # the stages share the user's modules, so what this rank's stages hold is named by
    # the user's keys; a PipelineModule's other layers do not exist here, so none is wanted
    held = {id(t) for t in engine.module.state_dict(keep_vars=True).values()}
    mine = {k: (tuple(t.shape), t.dtype) for i, (k, t) in user.items() if i in held}
    wanted = sorted(k for i, (k, _) in user.items() if i not in held)
    tables: list[Any] = [None] * group.size
    dist.all_gather_object(tables, (mine, wanted), group=group.pg)
    owner: dict[str, int] = {}
    for r, (has, _) in enumerate(tables):
        for k in has:
            owner.setdefault(k, r)
    tensors = {k: t for k, t in user.values()}
    sends: list[tuple[torch.Tensor, int]] = []
    recvs: list[tuple[str, torch.Tensor, int]] = []
    for r, (_, want) in enumerate(tables):  # per (owner, receiver) pair: sorted key order
        for k in want:
            src = owner.get(k)
            if src is None:  # no stage holds it (cannot happen for a split model)
                continue
            if src == group.rank:
                sends.append((tensors[k].detach().contiguous(), r))
            elif r == group.rank:
                shape, dtype = tables[src][0][k]
                buf = torch.empty(shape, dtype=dtype, device=engine.device)
                recvs.append((k, buf, src))
    works = comm.batch_p2p(group, sends=sends, label="pp_restore_send", tag=RESTORE_TAG)
    works += comm.batch_p2p(
        group, recvs=[(b, s) for _, b, s in recvs], label="pp_restore_recv", tag=RESTORE_TAG
    )
    for w in works:
        w.wait()
    with torch.no_grad():
        for k, buf, _ in recvs:
            t = tensors[k]
            t.data = buf.to(t.device)
            if isinstance(t, nn.Parameter):
                t.grad = None
