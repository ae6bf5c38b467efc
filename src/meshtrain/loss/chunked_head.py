"""``"loss": {"chunked": true}``: a causal LM's head and loss through chunked cross-entropy.

For a transformers ``*ForCausalLM`` (``lm_head`` + ``loss_function``) or meshtrain's
``Decoder`` (``lm_head`` + ``loss_fn``): while a forward carries ``labels``, the head does
not build logits; it computes the loss chunk by chunk from its input hidden states and
its own weight (``chunked_cross_entropy``, inside the head's forward, so a ZeRO-3 unit
has the weight gathered then) and returns the hidden states in place of the logits. The
model's loss function then returns that loss. So with labels, ``outputs.logits`` holds
the final hidden states, not logits (as Liger-Kernel's fused loss leaves ``logits``
empty); without labels (generation, ``predict`` without labels) the head is unchanged.

Loss semantics are the models' own: the next-token shift, ``-100`` ignored, and for
transformers ``num_items_in_batch`` (sum over the window's items / that count). Under
tensor parallelism the head holds vocabulary rows ``[r V_l, (r + 1) V_l)`` and the loss is
the vocab-parallel form (``group``); sequence parallelism and pipeline parallelism are
refused by name (their heads see a slice of the sequence / another stage).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.loss.chunked_cross_entropy import chunked_cross_entropy

IGNORE = -100


class _Pending:
    """The labels of the forward in progress and the loss its head computed."""

    def __init__(self) -> None:
        self.labels: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.items: torch.Tensor | None = None  # non-ignored targets of that loss


def apply_chunked_loss(model: nn.Module, chunk_size: int, group=None) -> list:
    """Install the chunked head and loss on ``model`` (module docstring); returns the
    hook handles. ``group``: the tensor-parallel group when the head is vocab-sharded."""
    if hasattr(model, "get_base_model"):  # peft: the head and loss are the base model's
        model = model.get_base_model()
    head = getattr(model, "lm_head", None)
    hf = hasattr(model, "loss_function") and type(model).__name__.endswith("ForCausalLM")
    if not isinstance(head, nn.Module) or not (hf or hasattr(model, "loss_fn")):
        raise ConfigError(
            f"loss.chunked: {type(model).__name__} has no lm_head with a causal-LM loss "
            "(transformers *ForCausalLM or meshtrain's Decoder); set loss.chunked false or "
            "call meshtrain.loss.chunked_cross_entropy from your own loss"
        )
    if getattr(head, "bias", None) is not None:
        raise ConfigError("loss.chunked: the lm_head has a bias, which is not supported")
    pending = _Pending()
    tp_rank = group.rank if group is not None else 0
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or getattr(
        getattr(model, "cfg", None), "vocab_size", None
    )
    original = head.forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        labels = pending.labels
        if labels is None:
            return original(hidden)
        pending.labels = None
        shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1 : hidden.shape[-2] + 1]
        v_local = self.weight.shape[0]
        pending.loss = chunked_cross_entropy(
            hidden, self.weight, shifted.to(hidden.device), chunk_size=chunk_size,
            group=group, vocab_start=tp_rank * v_local, vocab_size=vocab or v_local,
        )  # fmt: skip
        pending.items = (shifted != IGNORE).sum()
        # a new tensor, not the input: ZeRO-3 hooks this unit's outputs to gather the
        # head again before its backward (``loss`` below makes it reach the loss)
        return hidden.view_as(hidden)

    head.forward = types.MethodType(forward, head)

    def remember(_module, args, kwargs):
        labels = kwargs.get("labels")
        if labels is None and not hf and len(args) > 1:
            labels = args[1]  # Decoder.forward(input_ids, labels)
        pending.labels, pending.loss = labels, None

    def loss(*args, num_items_in_batch=None, **kwargs):
        if pending.loss is None:
            raise RuntimeError("loss.chunked: the head computed no loss for this forward")
        value, pending.loss = pending.loss, None
        out = kwargs.get("logits", args[0] if args else None)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # zero, but on the graph: backward reaches the head's output (created after
            # the loss node, so autograd runs it first) and ZeRO-3 regathers the head
            # weight before the chunked loss's backward accumulates its gradient
            value = value + 0.0 * out.sum()
        if num_items_in_batch is not None:  # transformers: sum over items / window count
            value = value * pending.items.clamp(min=1) / num_items_in_batch
        return value

    handle = model.register_forward_pre_hook(remember, with_kwargs=True)
    if hf:
        model.loss_function = loss
    else:
        model.loss_fn = loss
    return [handle]


def check_layout(config, topology) -> None:
    """What loss.chunked cannot combine with, refused by name."""
    if topology.pp_size > 1:
        raise ConfigError(
            "loss.chunked: not supported with pipeline parallelism (the head is on the last "
            "stage's own loss path); set loss.chunked false"
        )
    if topology.tp_size > 1 and config.tensor_parallel.sequence_parallel:
        raise ConfigError(
            "loss.chunked: not supported with tensor_parallel.sequence_parallel (the head "
            "sees a slice of the sequence); set one of them false"
        )
