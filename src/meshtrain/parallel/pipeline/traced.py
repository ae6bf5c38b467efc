"""Cutting a model with no block list by tracing its forward: a chain of its children.

A model such as seed 003's ``BasicNet`` (convolutions, pooling, dropout, linears, called
one after another in ``forward``) has no ``nn.ModuleList`` of blocks for a ``Layout``.
``torch.fx.symbolic_trace`` records its forward as a graph of the calls it makes, in
forward order; the graph is cut between calls:

* a *unit* is a call that uses parameters (a submodule holding any, or a parameter read
  directly) with the parameter-free calls after it up to the next such call (those
  before the first go with the first); stages are contiguous runs of units (at least one
  each, so every stage holds parameters), balanced as ``split``'s: by parameters (the
  default), uniformly by units, or at ``cut_points`` (unit indices);
* what crosses a boundary is every value computed before it and used after it: one
  tensor, or a tuple of them (a ``pytree`` boundary); the forward's own arguments are
  not sent, every stage reads them from the micro-batch (a dict by argument name, a
  tuple/list by position, or the one tensor);
* stage ``k`` runs its calls as the traced graph does (the same modules, functions and
  methods with the same arguments, so a stage chain is the model's forward op for op);
  the last returns the forward's outputs.

Sound only where tracing is: a forward whose Python control flow depends on tensor values
cannot be traced and is refused by name (``ConfigError``), as is a boundary value that is
not a tensor. The model's parameters keep their names (the stage's module tree holds the
model's own submodules at their paths).

Dropout draws its masks on the rank that runs it, from that rank's generator: under a
pipeline the masks are not those of one process running the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.split import bounds_from_cuts, partition

__all__ = ["TracedStage", "split_traced"]


def _trace(model: nn.Module):
    import torch.fx

    class _Tracer(torch.fx.Tracer):
        """torch's tracer, with meshtrain's own parallel layers (a tensor-parallel
        linear or embedding, already in place when a pipeline splits a model under tp)
        recorded as calls: their forwards run collectives, which are not graph ops, and a
        call keeps the layer's parameters in the stage that calls it."""

        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            own = type(m).__module__.startswith("meshtrain.parallel.")
            return own or super().is_leaf_module(m, qualname)

    try:
        tracer = _Tracer()
        graph = tracer.trace(model)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError, ...)
        raise ConfigError(
            f"cannot split {type(model).__name__} into pipeline stages: it has no known block "
            f"list and its forward cannot be traced ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); build it with "
            "meshtrain.pipe.PipelineModule, or pass layout=Layout(blocks=..., ...)"
        ) from exc


def _params_of(gm, model: nn.Module, node) -> int:
    if node.op == "call_module":
        return sum(p.numel() for p in model.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        t = _fetch(model, node.target)
        return t.numel() if isinstance(t, nn.Parameter) else 0
    return 0


def _fetch(root: nn.Module, path: str):
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _subtree(model: nn.Module, paths: Sequence[str]) -> nn.Module:
    """A fresh module tree holding only ``model``'s objects at ``paths`` (submodules, or
    parameters / buffers read directly), under the same paths: parameter names stay the
    model's."""
    root = nn.Module()
    for path in paths:
        *parents, leaf = path.split(".")
        node, src = root, model
        for part in parents:
            src = getattr(src, part)
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        obj = getattr(src, leaf)
        if isinstance(obj, nn.Module):
            node.add_module(leaf, obj)
        elif isinstance(obj, nn.Parameter):
            node.register_parameter(leaf, obj)
        else:
            node.register_buffer(leaf, obj)
    return root


class TracedStage(nn.Module):
    """Stage ``index`` of ``num_stages`` of a traced model: the graph's calls ``nodes``;
    ``incoming`` / ``outgoing``: the names of the values its boundaries carry."""

    def __init__(self, model, graph, index, num_stages, nodes, incoming, outgoing) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        # the last stage returns the model's outputs when the caller computes the loss
        # (``PipelineRuntime.train_step(loss_fn=)``), else they must be the loss
        self.whole_outputs = False
        self.router_aux = None  # no MoE layers here (``router_aux``)
        self.nodes = list(nodes)
        self.incoming, self.outgoing = tuple(incoming), tuple(outgoing)
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        used = sorted({n.target for n in self.nodes if n.op in ("call_module", "get_attr")})
        self.model = _subtree(model, used)
        ids = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.names = {ids[id(p)]: p for p in self.model.parameters()}
        self.block_ids = tuple(range(len(self.nodes)))

    def model_key(self, key: str) -> str:
        """The unsplit model's state-dict key of this stage's ``key``."""
        return key.removeprefix("model.")

    def _arguments(self, batch) -> dict[str, Any]:
        env: dict[str, Any] = {}
        for i, ph in enumerate(self.placeholders):
            name = ph.target
            if isinstance(batch, dict):
                found = name in batch
                value = batch.get(name)
            elif isinstance(batch, (tuple, list)):
                found, value = i < len(batch), batch[i] if i < len(batch) else None
            else:
                found, value = i == 0, batch
            if not found and ph.args:  # the forward's default
                found, value = True, ph.args[0]
            if not found:
                raise ConfigError(
                    f"the micro-batch has no {name!r}, an argument of the model's forward "
                    f"(stage {self.index}); give it under that key"
                )
            env[ph.name] = value
        return env

    def forward(self, x, batch):
        """``x``: the previous stage's values (None on stage 0); ``batch``: the
        micro-batch, whose entries are the forward's arguments."""
        from torch.fx.node import map_arg

        env = self._arguments(batch)
        if not self.is_first:
            values = (x,) if len(self.incoming) == 1 else tuple(x)
            env.update(zip(self.incoming, values, strict=True))
        for node in self.nodes:
            args = map_arg(node.args, lambda n: env[n.name])
            kwargs = map_arg(node.kwargs, lambda n: env[n.name])
            if node.op == "call_module":
                env[node.name] = self.model.get_submodule(node.target)(*args, **kwargs)
            elif node.op == "call_function":
                env[node.name] = node.target(*args, **kwargs)
            elif node.op == "call_method":
                env[node.name] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:  # get_attr
                env[node.name] = _fetch(self.model, node.target)
        if not self.is_last:
            out = tuple(env[n] for n in self.outgoing)
            return out[0] if len(out) == 1 else out
        result = map_arg(self.output.args[0], lambda n: env[n.name])
        if self.whole_outputs or (isinstance(result, torch.Tensor) and result.dim() == 0):
            return result
        raise ConfigError(
            f"the last pipeline stage of a traced model returned {type(result).__name__}"
            f"{tuple(result.shape) if isinstance(result, torch.Tensor) else ''}, not a loss: "
            "return the loss from forward, or train with the Trainer and compute the loss "
            "in compute_loss / compute_loss_func (they run on the last stage)"
        )


def split_traced(
    model: nn.Module,
    num_stages: int,
    *,
    method: str = "parameters",
    cut_points: Sequence[int] | None = None,
) -> list[TracedStage]:
    """All ``num_stages`` stages of ``model`` cut from its traced forward (module
    docstring)."""
    gm = _trace(model)
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    units: list[list] = []
    weights: list[int] = []
    for node in calls:
        w = _params_of(gm, model, node)
        if w or not units:
            units.append([node])
            weights.append(w)
        else:
            units[-1].append(node)
    if units and not weights[0] and len(units) > 1:  # parameter-free calls lead: merge
        units[1] = units[0] + units[1]
        del units[0], weights[0]
    n = len(units)
    if cut_points is not None:
        bounds = bounds_from_cuts(cut_points, n, num_stages)
    elif method == "uniform":
        bounds = partition([1] * n, num_stages)
    elif method == "parameters":
        bounds = partition(weights, num_stages)
    else:
        raise ConfigError(
            f"pipeline.partition_method={method!r} is unknown for automatic splitting; use "
            "'parameters', 'uniform' or give cut_points"
        )
    groups = [[nd for u in units[bounds[k] : bounds[k + 1]] for nd in u] for k in range(num_stages)]
    position = {nd: k for k, g in enumerate(groups) for nd in g}
    output = next(nd for nd in gm.graph.nodes if nd.op == "output")
    crossing: list[list[str]] = []  # names live across boundary k (between k-1 and k)
    for k in range(1, num_stages):
        live = []
        for nd in calls:
            if position[nd] >= k:
                continue
            later = [u for u in nd.users if u is output or position.get(u, -1) >= k]
            if later:
                live.append(nd.name)
        crossing.append(live)
    return [
        TracedStage(
            model,
            gm.graph,
            k,
            num_stages,
            groups[k],
            crossing[k - 1] if k else (),
            crossing[k] if k < num_stages - 1 else (),
        )
        for k in range(num_stages)
    ]
