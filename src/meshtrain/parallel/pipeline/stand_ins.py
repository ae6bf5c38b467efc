"""What a split stage puts in place of the modules it does not run (``split``'s
``SplitStage``): the received activation where the embedding was, nothing where learned
positions were, and, under sequence parallelism, the received shard at the first block's
input and the kept shard where the model reshapes to the full length."""

from __future__ import annotations

import torch
from torch import nn


class Input(nn.Module):
    """Stands in for the embedding on later stages: returns the received activation."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.value


class KeepShard(nn.Module):
    """Stands in for the module after which the model reshapes to the full length
    (``Layout.reshapes_after``) on a stage before the last under sequence parallelism:
    keeps a sequence shard and returns a full-length placeholder the reshape accepts."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0  # the micro-batch's full sequence length, set per forward
        self.value: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or x.shape[1] == self.length:
            return x  # the whole sequence already: nothing to keep
        self.value = x
        return x.new_zeros(()).expand(x.shape[0], self.length, *x.shape[2:])


class Zero(nn.Module):
    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(())


def replace_first_input(x: torch.Tensor):
    """A forward pre-hook (``with_kwargs``) putting ``x`` in place of a block's first input
    (positional, or ``hidden_states=``), as the tensor-parallel plans' hooks do."""

    def pre(_mod, args, kwargs):
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    return pre


__all__ = ["Input", "KeepShard", "Zero", "replace_first_input"]
