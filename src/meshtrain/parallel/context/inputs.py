"""Each cp rank's share of a batch, and a loss that counts tokens over the whole sequence.

Installed as a forward pre-hook and a forward hook on the model (``apply.py``), so every
way in (``engine(...)``, the Trainer, ``prepare``) hands the model whole rows, exactly as
without context parallelism. The cp ranks of one dp coordinate see the same rows (the
sampler deals over dp only); the pre-hook keeps this rank's chunks (``layout.py``):

1. ``position_ids``: the given ones (packed rows restart at 0 per document) or
   ``0 .. L-1``; ``document_ids`` are derived from the *whole* rows' positions (a new
   document wherever a position is 0) before any cut, so ids are global.
2. ``labels`` are shifted over the whole row first (``shift[t] = labels[t+1]``, the last
   -100), so the token at a chunk border still predicts the first token of the next
   chunk, which lives on another rank.
3. A length that 2C does not divide is **padded** at the end to the next multiple:
   ``input_ids`` with 0, labels with -100 (never counted), positions continuing, the
   last document extended. Causal attention keeps real tokens from seeing the pads.
   Refused for a mixture-of-experts model, as is a mask with zeros: its routers would
   count the pads in the auxiliary loss.
4. ``attention_mask``: all ones or right padding (each row's ones a prefix) is dropped
   (causality already keeps real tokens from the pads; their labels must be -100, as
   every meshtrain collator makes them); left padding is refused by name.
5. Each of ``input_ids``, ``position_ids``, ``document_ids``, shifted labels is cut to
   this rank's chunks; the model gets the shifted labels as ``shift_labels`` (transformers'
   loss and the Decoder's accept it) with ``num_items_in_batch = N / C``.

The loss. With ``N`` the valid (non -100) shifted labels of the whole rows (or the
caller's ``num_items_in_batch``, e.g. a whole accumulation window's) and ``S_r`` the
sum of token losses on cp rank ``r``, rank ``r``'s loss is ``S_r / (N / C) = C S_r / N``.
The gradient reducer averages over dp x cp (divides by ``dp C``), so a dp coordinate's
cp ranks together contribute ``sum_r C grad S_r / (N dp C) = grad(sum_r S_r / N) / dp``:
exactly the gradient of the single-process mean over every valid token of those rows,
averaged over dp as data parallelism does. The value the model returns is the global
mean ``sum_r S_r / N`` (one all-reduce of a scalar over cp, label ``control``), with the
gradient of the local share: ``loss + (mean - loss).detach()``.

Without labels the model returns this rank's chunks of the logits (cp layout).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from meshtrain.components.documents import documents_from_positions
from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.errors import ConfigError
from meshtrain.parallel.context import layout

IGNORE = -100
CUT = "meshtrain_cp_cut"  # kwarg marking a batch already cut to this rank's chunks


class SequenceSharder:
    """The pre-hook (cut the batch) and the forward hook (the loss's value) of one model.

    ``family``: "decoder" (meshtrain's Decoder: ``document_ids=``) or "transformers"
    (``meshtrain_document_ids=`` down to the registered attention, ``use_cache=False``).
    """

    def __init__(
        self, model: torch.nn.Module, group: Group, family: str, routes: bool = False
    ) -> None:
        self.group, self.family = group, family
        # a MoE model's routers count every token they see in the auxiliary loss, pads too
        # (the mask is dropped here): rows with padding are refused for it (``pre``)
        self.routes = routes
        self.signature = inspect.signature(model.forward)

    def _arguments(self, args: tuple, kwargs: dict) -> dict:
        bound = self.signature.bind(*args, **kwargs)
        out = {}
        for name, value in bound.arguments.items():
            param = self.signature.parameters[name]
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                raise ConfigError(f"context parallelism: positional *{name} is not understood")
            else:
                out[name] = value
        return out

    def pre(self, _module, args: tuple, kwargs: dict):
        if kwargs.pop(CUT, False):  # a backbone called by its already-cut model
            return args, kwargs
        a = self._arguments(args, kwargs)
        ids = a.get("input_ids")
        if ids is None or ids.dim() != 2:
            raise ConfigError(
                "context parallelism: the model must be called with input_ids [batch, "
                f"seq] (got {None if ids is None else tuple(ids.shape)}); inputs_embeds "
                "are not sharded by meshtrain"
            )
        if a.get("past_key_values") is not None or a.get("cache") is not None:
            raise ConfigError(
                "context parallelism: a key/value cache (generation) is not built under cp; "
                "generate with the model outside the cp mesh (load the checkpoint at cp 1)"
            )
        c, rank = self.group.size, self.group.rank
        b, length = ids.shape
        mask = a.pop("attention_mask", None)
        _check_mask(mask)
        labels, shift = a.pop("labels", None), a.pop("shift_labels", None)
        if shift is None and labels is not None:
            shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        pos = a.get("position_ids")
        if pos is None:
            pos = torch.arange(length, device=ids.device).expand(b, length)
        docs = a.pop("document_ids", None)
        if docs is None:
            docs = documents_from_positions(pos)
        pad = (-length) % (2 * c)
        if self.routes and (pad or (mask is not None and not bool(mask.bool().all()))):
            raise ConfigError(
                f"context parallelism of a mixture-of-experts model: rows with padding "
                f"(length {length}, a multiple of 2 x cp = {2 * c} needed, and no 0 in "
                "attention_mask) would send pad tokens through the routers and into the "
                "auxiliary loss; pack the rows (position_ids restarting at 0) to a multiple "
                f"of {2 * c} tokens"
            )
        if pad:
            ids = F.pad(ids, (0, pad), value=0)
            pos = torch.cat((pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)), 1)
            shift = None if shift is None else F.pad(shift, (0, pad), value=IGNORE)
            docs = None if docs is None else torch.cat((docs, docs[:, -1:].expand(b, pad)), 1)
        types = a.get("token_type_ids")  # GPT-2's segment embeddings: per token, like ids
        if types is not None:
            a["token_type_ids"] = layout.shard(F.pad(types, (0, pad)), rank, c)
        a["input_ids"] = layout.shard(ids, rank, c)
        a["position_ids"] = layout.shard(pos, rank, c).contiguous()
        local_docs = None if docs is None else layout.shard(docs, rank, c)
        if self.family == "decoder":
            a["document_ids"] = local_docs
        else:
            a["use_cache"] = False
            a[CUT] = True  # passed down to the backbone (its own hook under a pipeline)
            if local_docs is not None:
                a["meshtrain_document_ids"] = local_docs
        if shift is not None:
            items = a.pop("num_items_in_batch", None)
            if items is None:
                items = (shift != IGNORE).sum().clamp(min=1)
            local = layout.shard(shift, rank, c)
            a["shift_labels"] = local
            a["num_items_in_batch"] = torch.as_tensor(items, dtype=torch.float32) / c
            # transformers computes a loss only when labels is not None; with shift_labels
            # given it never shifts them again. The Decoder takes shift_labels alone.
            a["labels"] = local if self.family == "transformers" else None
        return (), a

    def post(self, _module, _args, kwargs: dict, out):
        if kwargs.get("shift_labels") is None:
            return out
        loss = _loss_of(out)
        if loss is None:
            return out
        mean = loss.detach().clone()
        comm.all_reduce(mean, self.group, label="control")
        mean /= self.group.size
        return _with_loss(out, loss + (mean - loss.detach()))


def _check_mask(mask: torch.Tensor | None) -> None:
    if mask is None or mask.dim() != 2:
        if mask is not None:
            raise ConfigError(
                f"context parallelism: a {mask.dim()}-d attention_mask is not understood; "
                "pass a [batch, seq] padding mask or none (packed rows: position_ids)"
            )
        return
    ones = mask.bool()
    # right padding: once a row turns 0 it stays 0 (its ones are a prefix)
    if bool((ones[:, 1:] & ~ones[:, :-1]).any()):
        raise ConfigError(
            "context parallelism: attention_mask has left (or inner) padding; pad on the "
            "right with -100 labels, or pack the rows (position_ids restarting at 0)"
        )


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else None
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        loss = out[0] if out[0].dim() == 0 else None
    return loss


def _with_loss(out, loss):
    if isinstance(out, torch.Tensor):
        return loss
    if hasattr(out, "loss"):
        out.loss = loss
        if isinstance(out, dict):
            out["loss"] = loss
        return out
    return (loss, *out[1:])


__all__ = ["SequenceSharder"]
