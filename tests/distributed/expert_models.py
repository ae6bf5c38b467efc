"""A hand-made mixture-of-experts model for the optimizer-side tests of expert parallelism.

``ToyMoE`` is a residual MLP whose blocks hold a router (replicated, non-expert) and a
stack of ``E`` experts ``w1: (E, d, h)``, ``w2: (E, h, d)``. With ``ep > 1`` each rank
builds the same full model (one seed) and keeps experts ``[i E/ep, (i+1) E/ep)`` of ep rank
``i``, marked with ``meshtrain.parallel.experts.mark_expert_param`` (dimension 0 is the
expert dimension, as the checkpoint's resharding expects). Routing is top-1 (softmax, the
gate is the winner's probability). Tokens reach their expert's rank by an all-gather over
the ep group and come back by an all-reduce (autograd functions below): more bytes than an
all-to-all, but the same gradient, which is all these tests need; the real dispatch is
``meshtrain.parallel.experts``'s. An expert that gets no token is skipped (its rows of the
stacked weights get no gradient from this rank; a rank whose experts all get nothing gets
no expert gradient at all), the case that hangs ZeRO-3 in other frameworks.

``route_to``: add a large bias to that expert's logit, so every token goes there (the
skewed-routing test). ``global_expert_state`` puts the ranks' slices back together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

DIM, HIDDEN, EXPERTS = 8, 12, 4


class _GatherTokens(torch.autograd.Function):
    """(n, ...) per rank -> (ep n, ...) on every rank; backward: sum, then own rows."""

    @staticmethod
    def forward(ctx, x, pg, size, rank):
        ctx.pg, ctx.rank, ctx.n = pg, rank, x.shape[0]
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x.contiguous(), group=pg)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


class _CombineTokens(torch.autograd.Function):
    """(ep n, ...) partial outputs -> summed over ranks, own rows; backward: all-gather."""

    @staticmethod
    def forward(ctx, y, pg, size, rank):
        ctx.pg, ctx.size = pg, size
        y = y.contiguous().clone()
        dist.all_reduce(y, group=pg)
        n = y.shape[0] // size
        return y[rank * n : (rank + 1) * n]

    @staticmethod
    def backward(ctx, grad):
        out = [torch.empty_like(grad) for _ in range(ctx.size)]
        dist.all_gather(out, grad.contiguous(), group=ctx.pg)
        return torch.cat(out), None, None, None


class MoEBlock(nn.Module):
    def __init__(self, ep_size: int, ep_rank: int, group, route_to: int | None) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)
        self.local = EXPERTS // ep_size
        self.first = ep_rank * self.local
        if ep_size > 1:
            from meshtrain.parallel.experts import mark_expert_param

            keep = slice(self.first, self.first + self.local)
            self.w1 = nn.Parameter(self.w1.data[keep].clone())
            self.w2 = nn.Parameter(self.w2.data[keep].clone())
            mark_expert_param(self.w1)
            mark_expert_param(self.w2)
        self.group = group  # (process group, size, rank) of ep, or None
        bias = torch.zeros(EXPERTS)
        if route_to is not None:
            bias[route_to] = 100.0
        self.register_buffer("route_bias", bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h) + self.route_bias, dim=-1)
        idx = probs.argmax(dim=-1)
        gate = probs.gather(1, idx[:, None])
        if self.group is not None:
            pg, size, rank = self.group
            h = _GatherTokens.apply(h, pg, size, rank)
            gate = _GatherTokens.apply(gate, pg, size, rank)
            everyone = [torch.empty_like(idx) for _ in range(size)]
            dist.all_gather(everyone, idx, group=pg)
            idx = torch.cat(everyone)
        # zeros that depend on h and gate: the backward collectives of both exchanges
        # run on every rank even when none of its experts gets a token
        y = (h * gate) * 0.0
        for j in range(self.local):
            rows = (idx == self.first + j).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue  # no token for this expert from any rank of the ep group
            out = torch.relu(h[rows] @ self.w1[j]) @ self.w2[j]
            y = y.index_add(0, rows, gate[rows] * out)
        if self.group is not None:
            y = _CombineTokens.apply(y, *self.group)
        return y


class ToyMoE(nn.Module):
    """``inp`` -> 2 residual MoE blocks -> ``head``; ``forward(x, y)`` returns the MSE."""

    def __init__(
        self, ep_size: int = 1, ep_rank: int = 0, group=None, route_to: int | None = None
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            self.inp = nn.Linear(DIM, DIM)
            self.blocks = nn.ModuleList(
                MoEBlock(ep_size, ep_rank, group, route_to) for _ in range(2)
            )
            self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.mse_loss(self.head(h), y)


def toy_moe(topology=None, route_to: int | None = None, frozen_experts: bool = False) -> ToyMoE:
    """The model as ``topology``'s rank holds it (None: one process, every expert);
    ``frozen_experts``: the experts do not train (``requires_grad=False``)."""
    if topology is None or topology.ep_size == 1:
        model = ToyMoE(route_to=route_to)
    else:
        ep = topology.ep_group
        model = ToyMoE(ep.size, ep.rank, (ep.pg, ep.size, ep.rank), route_to)
    for name, p in model.named_parameters():
        if frozen_experts and is_expert_name(name):
            p.requires_grad_(False)
    return model


def is_expert_name(name: str) -> bool:
    return name.endswith((".w1", ".w2"))


def toy_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, 3, generator=g)


def global_expert_state(states_by_ep_rank: list[dict]) -> dict:
    """The one-process state dict from each ep rank's (local experts along dim 0)."""
    first = states_by_ep_rank[0]
    return {
        k: torch.cat([s[k] for s in states_by_ep_rank]) if is_expert_name(k) else v
        for k, v in first.items()
    }
