"""The experts' SwiGLU on tokens grouped by expert: one grouped GEMM, or a loop.

Rows ``x`` (``[R, H]``) arrive sorted by local expert, ``counts[l]`` rows for expert ``l``.
With the transformers layout (``gate_up [L, 2F, H]``, ``down [L, H, F]``)::

    [g | u] = x_l @ gate_up[l]^T      (R_l x 2F)
    y_l     = (act(g) * u) @ down[l]^T (R_l x H)

FLOPs: ``6 R H F`` forward whatever the grouping. Two implementations:

* ``grouped``: ``torch._grouped_mm(x, W^T, offs=cumsum(counts))``, one kernel per
  projection for all experts (torchtitan's path). torch 2.14 runs it on CPU in fp32/bf16 and
  on CUDA (sm80+) in bf16.
* ``loop``: one ``F.linear`` per expert, the transformers reference.

:func:`choose` picks once per layer (at its first forward) by running the grouped kernel
forward and backward on a few rows with the layer's own weight shapes, device and dtype;
any error means ``loop``. Both give the same numbers within fp32 rounding
(``tests/distributed/test_moe.py``).

Every local expert takes part in the computation even with zero rows, so its weights
always receive a gradient (zeros) and a gradient hook that waits on it fires on every rank
whatever the routing (the ZeRO hang of DeepSpeed#4808 comes from such a missing gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

GEMMS = ("grouped", "loop")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``_grouped_mm``'s
    backward refuses the stride-0 gradient of e.g. ``y.sum()``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # w: [L, out, in] (transformers' layout) -> the kernel's [L, in, out]
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def swiglu_grouped(x, gate_up, down, counts: Sequence[int], act: Callable) -> torch.Tensor:
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    gate, up = _grouped(x, gate_up, offs).chunk(2, dim=-1)
    return _grouped(act(gate) * up, down, offs)


def swiglu_loop(x, gate_up, down, counts: Sequence[int], act: Callable) -> torch.Tensor:
    out, start = [], 0
    for e, n in enumerate(counts):  # zero rows too: every expert's weights get a gradient
        gate, up = F.linear(x[start : start + n], gate_up[e]).chunk(2, dim=-1)
        out.append(F.linear(act(gate) * up, down[e]))
        start += n
    return torch.cat(out) if out else x.new_zeros(0, down.shape[1])


def choose(gate_up: torch.Tensor, down: torch.Tensor, act: Callable) -> str:
    """``"grouped"`` when ``torch._grouped_mm`` runs forward and backward for these weights'
    shapes, device and dtype, else ``"loop"``."""
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    # its own saved-tensor hooks: under activation checkpointing the probe (first forward
    # only) must not add to what the checkpoint expects the recomputation to save
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    try:
        with torch.enable_grad(), identity:  # one expert is enough: shapes are per expert
            gu = gate_up.detach()[:1].clone().requires_grad_()
            dn = down.detach()[:1].clone().requires_grad_()
            x = gu.new_zeros(2, gu.shape[-1], requires_grad=True)
            swiglu_grouped(x, gu, dn, [2], act).sum().backward()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return "loop"
    return "grouped"


SWIGLU = {"grouped": swiglu_grouped, "loop": swiglu_loop}

__all__ = ["GEMMS", "SWIGLU", "choose", "swiglu_grouped", "swiglu_loop"]
