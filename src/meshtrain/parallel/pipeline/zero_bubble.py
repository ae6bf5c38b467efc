"""ZB-H1's split backward: ``B`` the input gradient, ``W`` the weight gradients, each once.

``B`` runs ``autograd.grad`` from the stage's output to its input and, on the way, saves
the gradient arriving at every *intermediate* node: a node on the input's path whose
backward also leads to a weight (the matmul of ``x @ W^T``, the product of a norm). ``W``
then runs ``autograd.grad`` from those intermediates to the weights only, so no node
between the output and the intermediates runs twice (Qi et al., 2023). The graph
analysis is ``torch.distributed.pipelining``'s (``stage_backward_input`` /
``stage_backward_weight``, torch's own ZB schedules use them).

A weight none of whose paths meets the input's (a term of the loss that depends on a
weight alone) is in no intermediate's group: ``W`` walks the graph again from the
output towards those weights only, so the result is right whatever the model. On stage 0
there is no input gradient: ``B`` does nothing and ``W`` is the whole backward.

``W`` writes ``param.grad`` itself (a new tensor, then ``+=`` into it), without autograd's
accumulation hooks: the data-parallel reduction of a pipeline step does not rely on them
(ZeRO 0-1 reduce after the schedule, whose ``finish`` copies such gradients into the flat
buffer first; ZeRO 2 in ``after_backward``, which launches every bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class WeightWork:
    """What ``B`` leaves for ``W``: torch's parameter groups (intermediates and the
    gradients saved at them), the weights, and the output for the uncovered weights."""

    params: list[nn.Parameter]
    groups: list[dict]
    rest: list[nn.Parameter]
    output: list[torch.Tensor]
    grad: list[torch.Tensor] | None


def backward_input(y: list, grad: list | None, x: list, params) -> WeightWork:
    """``B``: sets ``.grad`` of every tensor in ``x`` (the stage's inputs that need one:
    a tensor, or a pytree's gradient leaves), from the outputs ``y`` and their gradients
    ``grad`` (None: ``y`` is the loss); returns what ``W`` needs."""
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        stage_backward_input,
    )

    params = [p for p in params if p.requires_grad]
    # torch detaches the outputs it is given in place; hand it ``y * 1`` (exact) so ``y``
    # keeps its graph for the weights no group covers
    alias = [t * 1.0 for t in y]
    _, groups = stage_backward_input(alias, grad, list(x), iter(params))
    covered = {node for g in groups for node in g["params"]}
    rest = [p for p in params if _get_grad_fn_or_grad_acc(p) not in covered]
    return WeightWork(params, groups, rest, y, grad)


def backward_weight(work: WeightWork) -> list[nn.Parameter]:
    """``W``: accumulate every weight's gradient into ``param.grad``; returns the weights
    whose ``.grad`` it wrote without autograd's accumulation hooks (ZeRO's
    unused-parameter check is told of them: ``ZeroStage.after_backward``)."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    if work.rest:  # weights off the input's paths: from the output, towards them only
        torch.autograd.backward(work.output, work.grad, inputs=work.rest, retain_graph=True)
    stage_backward_weight(iter(work.params), work.groups)
    rest = {id(p) for p in work.rest}
    return [p for p in work.params if id(p) not in rest and p.grad is not None]


__all__ = ["WeightWork", "backward_input", "backward_weight"]
