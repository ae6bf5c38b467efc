"""Vocab-parallel cross-entropy: the loss of vocabulary-sharded logits, never gathered.

Rank ``r`` holds logits ``z[:, r V_l : (r + 1) V_l]`` of ``N`` tokens (``V_l`` = padded
vocabulary / T). The loss of token ``i`` with target ``t_i`` is
``log sum_j exp(z_ij - m_i) - (z_it - m_i)`` with ``m_i = max_j z_ij``:

1. local max over ``V_l``, all-reduce MAX over the group (``N`` floats);
2. this rank's share of the target logit (zero unless ``t_i`` is in its range) and its
   local ``sum exp(z - m)``, both all-reduced SUM in one call (``2N`` floats);
3. backward is local: ``softmax - onehot`` on this rank's columns, no communication.

Recorded per call (fp32, ``comm``'s convention): forward two all-reduces,
``2 x 4N + 2 x 8N = 24 N`` bytes; backward nothing. Memory: the fp32 copy of the local
logits and the saved softmax, ``[N, V_l]`` each; no rank ever holds ``[N, V]``
(Megatron-LM's vocab-parallel cross-entropy, plus what it lacks: ``ignore_index``).
Columns past the real vocabulary (padding to a multiple of T) are masked to ``-inf``.
Targets equal to ``ignore_index`` contribute no loss and no gradient and are left out
of the mean, as in ``F.cross_entropy``.
"""

from __future__ import annotations

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index):
        n_local = logits.shape[-1]
        start = group.rank * n_local
        z = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        real = max(0, min(n_local, vocab_size - start))  # columns that are real tokens
        if real < n_local:
            z[:, real:] = float("-inf")
        m = z.max(dim=-1).values
        comm.all_reduce(m, group, op=comm.ReduceOp.MAX)
        z -= m.unsqueeze(1)
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + n_local) & ~ignored
        local_t = (target - start).masked_fill(~mine, 0)
        # masked_fill, not a product: a padding-only rank gathers -inf
        picked = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        z.exp_()  # z is now exp(z - m)
        sums = torch.stack((picked, z.sum(dim=-1)))
        comm.all_reduce(sums, group)
        picked, sumexp = sums[0], sums[1]
        loss = (sumexp.log() - picked).masked_fill(ignored, 0.0)
        z /= sumexp.unsqueeze(1)  # softmax, kept for backward
        ctx.save_for_backward(z, local_t, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= mine.to(grad.dtype)
        grad *= grad_loss.masked_fill(ignored, 0.0).unsqueeze(1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    vocab_size: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, ignore_index=...)`` from vocab-sharded logits.

    ``logits``: ``[..., V_l]`` this rank's columns; ``target``: ``[...]`` global token
    ids (the same on every rank); ``vocab_size``: the real (unpadded) vocabulary.
    ``reduction``: "mean" (over non-ignored targets), "sum" or "none".
    """
    z = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1).to(z.device)
    losses = _VocabParallelCE.apply(z, t, group, vocab_size, ignore_index)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (t != ignore_index).sum()


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    group: Group,
    vocab_size: int,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """The reference decoder's loss (predict token t+1 at t; -100 ignored), vocab-parallel;
    ``shift_labels`` / ``num_items_in_batch`` as in ``meshtrain.models.decoder``."""
    if shift_labels is None:
        logits, shift_labels = logits[:, :-1], labels[:, 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = vocab_parallel_cross_entropy(logits, shift_labels, group, vocab_size, -100, reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


class HFLoss:
    """A ``transformers`` ``loss_function`` (ForCausalLM / ForMaskedLM) on sharded logits.

    Set as ``model.loss_function``; honours ``num_items_in_batch``, ``ignore_index`` and
    ``shift_labels`` like the ``transformers`` originals.
    """

    def __init__(self, group: Group, vocab_size: int, causal: bool) -> None:
        self.group, self.vocab_size, self.causal = group, vocab_size, causal

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        if self.causal and shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        target = shift_labels if self.causal else labels
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(
            logits, target, self.group, self.vocab_size, ignore_index, reduction
        )
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return loss


def recompute_masked_lm_loss(model: torch.nn.Module, group: Group, vocab_size: int) -> list:
    """Make ``model(..., labels=...)`` return the vocab-parallel masked-LM loss.

    For models whose forward computes ``CrossEntropyLoss()(logits.view(-1, vocab), ...)``
    inline (``BertForMaskedLM``), which vocab-sharded logits cannot feed: a pre-hook takes
    ``labels`` out of the call, and a forward hook puts the loss of the sharded logits
    (``-100`` ignored, mean over the rest) first in the output, where the model puts it.
    """
    loss_fn = HFLoss(group, vocab_size, causal=False)
    pending: list[torch.Tensor | None] = []  # one entry per call in flight

    def take_labels(_mod, args, kwargs):
        pending.append(kwargs.pop("labels", None))
        return args, kwargs

    def add_loss(_mod, _args, _kwargs, out):
        labels = pending.pop()
        if labels is None:
            return out
        if isinstance(out, tuple):
            return (loss_fn(out[0], labels), *out)
        return type(out)(loss=loss_fn(out.logits, labels), **{k: v for k, v in out.items()})

    return [  # handles: ``remove_tensor_parallel`` removes the hooks
        model.register_forward_pre_hook(take_labels, with_kwargs=True),
        model.register_forward_hook(add_loss, with_kwargs=True),
    ]


__all__ = [
    "HFLoss",
    "causal_lm_loss",
    "recompute_masked_lm_loss",
    "vocab_parallel_cross_entropy",
]
