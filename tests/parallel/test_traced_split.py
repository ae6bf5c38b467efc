"""The traced split (``parallel.pipeline.traced``), one process: a chain of a model's
traced stages is the model's forward bit for bit (the same calls in the same order),
what crosses each boundary, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.traced import split_traced
from tests.trainer.test_pipeline_overrides import BasicNet


class Skip(nn.Module):
    """A value used across a cut (``a`` is needed after ``fc3``): a tuple boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale=2.0):
        a = torch.tanh(self.fc1(x))
        b = torch.tanh(self.fc2(a) * scale)
        return self.fc3(b) + a


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else x


def _chain(stages, batch):
    h = None
    for s in stages:
        s.whole_outputs = True
        h = s(h, batch)
    return h


def test_traced_chain_is_the_forward_bitwise():
    torch.manual_seed(0)
    model, x = BasicNet(), torch.randn(3, 1, 28, 28)
    want = model(x)
    for n in (2, 3, 4):
        stages = split_traced(model, n)
        assert torch.equal(_chain(stages, {"x": x, "labels": None}), want)
        names = [sorted(s.names) for s in stages]
        assert sorted(k for ns in names for k in ns) == sorted(dict(model.named_parameters()))
        assert all(ns for ns in names)  # every stage holds parameters
    two = split_traced(model, 2)
    assert [s.outgoing for s in two] == [("flatten",), ()]  # the [b, 9216] activation
    assert torch.equal(_chain(split_traced(model, 2, method="uniform"), (x,)), want)
    assert torch.equal(_chain(split_traced(model, 2, cut_points=[1]), x), want)

    skip = Skip()
    stages = split_traced(skip, 3)
    assert [s.outgoing for s in stages] == [("tanh",), ("tanh", "tanh_1"), ()]  # (a, b)
    y = torch.randn(2, 4)
    assert torch.equal(_chain(stages, {"x": y}), skip(y))  # the default scale
    assert torch.equal(_chain(stages, {"x": y, "scale": 3.0}), skip(y, 3.0))


def test_traced_refusals():
    with pytest.raises(ConfigError, match="cannot be traced.*PipelineModule"):
        split_traced(Branchy(), 2)
    stages = split_traced(BasicNet(), 2)
    x = stages[0](None, {"x": torch.randn(1, 1, 28, 28)})
    with pytest.raises(ConfigError, match="not a loss.*compute_loss"):
        stages[1](x, {"x": None})
    with pytest.raises(ConfigError, match="no 'x'"):
        stages[0](None, {"pixels": torch.randn(1, 1, 28, 28)})
    with pytest.raises(ConfigError, match="cut_points"):
        split_traced(BasicNet(), 2, cut_points=[9])
