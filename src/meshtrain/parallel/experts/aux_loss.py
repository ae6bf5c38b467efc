"""The router's load-balancing loss over every replica's tokens, as one process computes it
(``loss.global_aux_loss``, Megatron's ``global_aux_loss``; by default each rank keeps the
loss of its own micro-batch, as DDP and DeepSpeed do, and this module only combines the
sequence shards of one replica under sequence parallelism).

transformers' ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6), over the router
logits of all layers, ``T`` rows in all (padding excluded by the attention mask)::

    f_e = (top-k assignments to e) / T      P_e = (sum of softmax probabilities of e) / T
    aux = E * sum_e f_e P_e

It is not linear in the batch: the mean over dp ranks of each rank's ``aux`` is *not* the
``aux`` of their union, which is what one process on the whole batch computes. With
``W = dp x cp`` replicas whose gradients are averaged (divided by ``W``), rank ``r`` uses
instead::

    aux_r = E * sum_e f_e * (W * S_e^r / T)       f_e, T: all-reduced over the replicas
                                                   S_e^r: this rank's probability sums

``f`` carries no gradient (top-k), so the mean over ranks of ``aux_r`` is the whole batch's
``aux`` and the mean of its gradients is the whole batch's gradient, exactly. Cost: one
all-reduce of ``E + 1`` fp32 per forward (``control``). With one replica, ``aux_r`` is
transformers' value.

Under tensor parallelism with sequence parallelism each of the ``T`` tp ranks of a replica
routes a ``1/T`` shard of its tokens (``parallel.tensor.moe_blocks``). ``f`` and ``T`` are
then summed over the tp group too (a second ``E + 1`` all-reduce), ``S_e^r`` is this
rank's shard's, and the router's gradients are summed over tp by the MoE block's gradient
hooks, so the sum over tp of the ranks' ``aux_r`` is the replica's. The value each rank
returns is that sum (one more scalar all-reduce), its gradient its own term's. A
transformers model's own auxiliary loss would pair the whole attention mask with the
shard's router logits, so there the logits are recorded by hooks on its routers (the
modules transformers records ``router_logits`` from) and the model's own term is skipped.

:func:`install_global_aux_loss` wraps a transformers ``...ForCausalLM`` forward so its
``loss`` and ``aux_loss`` use ``aux_r``; meshtrain's Decoder calls
:func:`load_balancing_loss` itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.errors import ConfigError


def load_balancing_loss(
    router_logits,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    group: Group | None = None,
    routing: str = "softmax_topk",
    sequence: Group | None = None,
) -> torch.Tensor:
    """``aux_r`` of the module docstring for the router logits of every layer (a tuple of
    ``[rows, E]``); transformers' value when ``group`` and ``sequence`` are None or of
    size 1. ``sequence``: the tp group when sequence parallelism hands each of its ranks a
    shard of the replica's tokens (module docstring)."""
    sums = router_sums(router_logits, num_experts, top_k, attention_mask, routing)
    return balance_loss(*sums, num_experts, group, sequence)


def router_sums(
    router_logits,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    routing: str = "softmax_topk",
    start: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts [E], prob_sum [E], rows [])`` over ``router_logits`` (one ``[rows, E]``
    per layer), fp32, added layer by layer onto ``start`` (the sums of earlier layers, e.g.
    received from the previous pipeline stage; zeros when None). Only ``prob_sum``
    carries a gradient: the counts come from top-k."""
    if start is None:
        device = router_logits[0].device
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
    else:
        counts, prob_sum, rows = start
        device = counts.device
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in router_logits:
        probs = torch.softmax(layer.float(), dim=-1)
        chosen = layer.float() if routing == "topk_softmax" else probs
        _, experts = torch.topk(chosen, top_k, dim=-1)
        weight = (
            torch.ones(experts.numel(), device=device)
            if mask is None
            else mask.repeat_interleave(top_k)
        )
        counts = counts.index_add(0, experts.reshape(-1), weight)
        prob_sum = prob_sum + (probs if mask is None else probs * mask[:, None]).sum(0)
        rows = rows + (probs.shape[0] if mask is None else mask.sum())
    return counts, prob_sum, rows


def balance_loss(
    counts: torch.Tensor,
    prob_sum: torch.Tensor,
    rows: torch.Tensor,
    num_experts: int,
    group: Group | None = None,
    sequence: Group | None = None,
) -> torch.Tensor:
    """``aux_r`` from the sums of :func:`router_sums` over every layer: ``counts`` and
    ``rows`` all-reduced over ``group`` (the replicas, ``E + 1`` floats, ``control``) and
    then over ``sequence`` (the tp group under sequence parallelism) when they have more
    than one rank, this rank's ``prob_sum`` scaled by the replica count."""
    scale = 1.0 if group is None else float(group.size)
    over = [g for g in (group, sequence) if g is not None and g.size > 1]
    if over:
        both = torch.cat([counts, rows.reshape(1)]).detach()
        for g in over:  # replicas, then the sequence shards of each: every token once
            comm.all_reduce(both, g, label="control")
        counts, rows = both[:-1], both[-1]
    aux = num_experts * torch.sum((counts / rows) * (prob_sum * scale / rows))
    if sequence is not None and sequence.size > 1:
        # the value of the replica's whole sequence (the tp ranks' terms summed), the
        # gradient of this rank's own term: its tokens' share, summed over tp by the
        # gradient hooks of the MoE blocks
        total = aux.detach().clone()
        comm.all_reduce(total, sequence, label="control")
        aux = aux + (total - aux.detach())
    return aux


def reduce_aux_loss_over(
    model: torch.nn.Module, group: Group | None, sequence: Group | None = None
) -> bool:
    """Reduce ``model``'s router auxiliary loss over ``group`` (the replicas) and
    ``sequence`` (the tp group under sequence parallelism, else None): meshtrain's
    Decoder through its ``aux_group`` / ``aux_sequence_group``, a transformers MoE causal
    LM through :func:`install_global_aux_loss`. False for a model without one (nothing
    changes)."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    if hasattr(model, "aux_group") and moe is not None:
        model.aux_group = group
        model.aux_sequence_group = sequence
        return True
    return install_global_aux_loss(model, group, sequence)


def install_global_aux_loss(
    model: torch.nn.Module, group: Group | None, sequence: Group | None = None
) -> bool:
    """Make a transformers MoE causal LM's ``loss`` use :func:`load_balancing_loss` over
    ``group`` (the replicas, dp x cp) and ``sequence`` (see :func:`load_balancing_loss`;
    the attention mask is then cut to this rank's sequence shard, as its router logits
    are). Returns False (and changes nothing) for a model without a router auxiliary loss.
    The model's own loss function and coefficient (``router_aux_loss_coef``) are kept;
    only the auxiliary term's reduction changes."""
    config = getattr(model, "config", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    needed = ("loss_function", "num_experts", "num_experts_per_tok", "vocab_size")
    if config is None or coef is None or not all(hasattr(model, n) for n in needed):
        return False
    forward = model.forward
    signature = inspect.signature(forward)
    top_k, n_experts = model.num_experts_per_tok, model.num_experts
    shards = sequence is not None and sequence.size > 1
    routers = _router_modules(model) if shards else ()

    @functools.wraps(forward)
    def global_aux_forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        a = bound.arguments
        labels = a.get("labels")
        wanted = a.get("output_router_logits")
        wanted = config.output_router_logits if wanted is None else wanted
        if not wanted or (labels is None and not shards):
            return forward(*args, **kwargs)
        a["labels"] = None  # the loss is recomputed below, with the global auxiliary term
        mask = a.get("attention_mask")
        if shards:
            # the model's own auxiliary loss would pair the whole attention mask with this
            # rank's shard of the router logits: it is skipped, the logits recorded here
            a["output_router_logits"] = False
            with _recording(routers) as logits:
                out = forward(*bound.args, **bound.kwargs)
            out.router_logits = tuple(logits)
            if mask is not None:
                mask = mask.chunk(sequence.size, dim=1)[sequence.rank]  # this rank's tokens
        else:
            a["output_router_logits"] = True
            out = forward(*bound.args, **bound.kwargs)
        aux = load_balancing_loss(
            out.router_logits, n_experts, top_k, mask, group, sequence=sequence
        )
        out.aux_loss = aux
        if labels is not None:
            extra = a.get("kwargs", {})
            loss = model.loss_function(out.logits, labels, model.vocab_size, **extra)
            out.loss = loss + coef * aux.to(loss.device)
        return out

    model.forward = global_aux_forward
    model.meshtrain_global_aux_loss = True
    return True


def _router_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(router module, index of its logits in its output) of every layer, in call order,
    from transformers' own record of where ``router_logits`` come from
    (``_can_record_outputs``); ConfigError naming the model when it has none."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    found = [m for m in model.modules() if target is not None and isinstance(m, target)]
    if not found:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel: true, but meshtrain cannot find the router "
            f"modules of {type(model).__name__} (transformers records none for it) to count "
            "each rank's sequence shard in the auxiliary loss; set sequence_parallel false"
        )
    return [(m, int(getattr(recorder, "index", 0) or 0)) for m in found]


@contextlib.contextmanager
def _recording(routers):
    """Collect each router's logits as its forward returns them, in call order."""
    logits: list[torch.Tensor] = []

    def keep(index):
        def hook(_module, _args, output):
            logits.append(output[index] if isinstance(output, tuple) else output)

        return hook

    handles = [m.register_forward_hook(keep(i)) for m, i in routers]
    try:
        yield logits
    finally:
        for h in handles:
            h.remove()


__all__ = [
    "balance_loss",
    "install_global_aux_loss",
    "load_balancing_loss",
    "reduce_aux_loss_over",
    "router_sums",
]
