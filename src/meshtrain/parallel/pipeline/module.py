"""DeepSpeed's form of a pipelined model: a flat list of layer specs, cut into stages.

::

    model = PipelineModule(
        layers=[TiedLayerSpec("embed", nn.Embedding, V, D), *[LayerSpec(Block, D)] * 8,
                nn.LayerNorm(D),
                TiedLayerSpec("embed", nn.Embedding, V, D, forward_fn=lambda emb, x: x @ emb.weight.T)],
        loss_fn=lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten()),
        topology=topology, partition_method="parameters")

The layers run in sequence; stage ``k`` of ``S = pp * virtual_stages`` runs a contiguous
range of them on pp rank ``k % pp``. A rank builds only the layers of its own stages
(``LayerSpec`` defers construction), each under the seed ``seed + layer index`` so the
weights do not depend on the split: one process with ``topology=None`` builds the same
model (the parity reference). Balancing (``partition_method``): ``"parameters"`` (counted
by building each spec on the meta device: no memory), ``"uniform"`` (layer count) or
``"type:REGEX"`` (the count of layers whose class name matches, e.g. ``"type:Block"``).

``TiedLayerSpec(key, ...)``: every occurrence of ``key`` is one module on a rank (built
under the seed of its first occurrence, so all ranks start equal); the ranks holding it
sum its gradients after the backward (``tied``: an all-reduce of its parameters' bytes
x 2 per step over those ranks). ``forward_fn(module, x)`` lets an occurrence use the
module differently (the LM head reading the embedding matrix).

Batches are ``(inputs, labels)``: the first stage consumes ``inputs``, the last returns
``loss_fn(output, labels)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.split import partition
from meshtrain.parallel.pipeline.tied import make_tied_groups


class LayerSpec:
    """A layer to build later: ``typename(*args, **kwargs)``."""

    def __init__(self, typename: type, *args: Any, **kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise ConfigError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every spec with the same ``key`` (its gradient summed over ranks)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *args: Any,
        forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = key, forward_fn


class _Stage(nn.Module):
    """Layers ``[start, stop)`` in order; the first takes the inputs, the last the loss."""

    def __init__(self, owner: PipelineModule, index: int, start: int, stop: int) -> None:
        super().__init__()
        self.index, self.start, self.stop = index, start, stop
        self.is_first, self.is_last = index == 0, index == owner.num_stages - 1
        self.run = nn.ModuleList()
        self.paths: list[str] = []  # the PipelineModule's path of each module in run
        self._calls: list[Callable] = []
        for i in range(start, stop):
            mod, fn = owner._layer(i)
            if isinstance(mod, nn.Module):
                self.run.append(mod)
                key = getattr(owner.specs[i], "key", None)
                self.paths.append(f"tied_modules.{key}" if key is not None else f"layers.{i}")
            self._calls.append(fn)
        self.loss_fn = owner.loss_fn
        # not a submodule: the stage is inside its owner, not the other way round
        object.__setattr__(self, "owner", owner)

    @property
    def names(self) -> dict[str, nn.Parameter]:
        """The PipelineModule's name of each of this stage's parameters; read when asked,
        since tensor parallelism replaces parameters after the stages are built."""
        mine = {id(p) for p in self.parameters()}
        return {n: p for n, p in self.owner.named_parameters() if id(p) in mine}

    def model_key(self, key: str) -> str:
        """The PipelineModule's state-dict key of this stage's ``key`` (``run.j.w`` ->
        ``layers.<i>.w``, ``i`` the layer's index in ``layers``, or ``tied_modules.<key>.w``):
        the same at every pipeline size, so checkpoints reshard."""
        head, _, tail = key.partition(".")
        if head != "run":  # e.g. an nn.Module loss_fn's buffers: the PipelineModule's key
            return key
        j, _, rest = tail.partition(".")
        return f"{self.paths[int(j)]}.{rest}"

    def forward(self, x, batch):
        if self.is_first:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
        for call in self._calls:
            x = call(x)
        if self.is_last and self.loss_fn is not None:
            return self.loss_fn(x, batch[1])
        return x


class PipelineModule(nn.Module):
    """Layers built per stage; see the module docstring."""

    def __init__(
        self,
        layers: Sequence[LayerSpec | nn.Module | Callable],
        num_stages: int | None = None,
        topology=None,
        loss_fn: Callable | None = None,
        partition_method: str = "parameters",
        virtual_stages: int = 1,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.specs, self.loss_fn, self.seed = list(layers), loss_fn, seed
        pp = topology.pp_size if topology is not None else 1
        if num_stages is not None and num_stages != pp:
            raise ConfigError(
                f"PipelineModule(num_stages={num_stages}) but the mesh has pp={pp}; pass "
                "topology with mesh.pipeline_parallel_size equal to num_stages"
            )
        self.pp, self.pp_rank = pp, (topology.pp_rank if topology is not None else 0)
        self.num_stages = pp * virtual_stages
        self.bounds = partition(self._weights(partition_method), self.num_stages)
        self.layers = nn.ModuleDict()  # built layers by index ("3"), tied ones under tied
        self.tied_modules = nn.ModuleDict()
        self._built: dict[int, tuple[Any, Callable]] = {}
        self.stages = {
            k: _Stage(self, k, self.bounds[k], self.bounds[k + 1])
            for k in range(self.num_stages)
            if k % pp == self.pp_rank
        }
        self.tied = make_tied_groups(*self._tied_holders(), topology) if topology else []

    # ---- construction ------------------------------------------------------------------
    def _weights(self, method: str) -> list[float]:
        if method == "uniform":
            return [1.0] * len(self.specs)
        if method == "parameters":
            out = []
            for spec in self.specs:
                if isinstance(spec, LayerSpec):
                    with torch.device("meta"):
                        spec = spec.build()
                n = sum(p.numel() for p in spec.parameters()) if isinstance(spec, nn.Module) else 0
                out.append(float(n))
            return out
        if method.startswith("type:"):
            pattern = re.compile(method[5:], re.IGNORECASE)
            return [
                1.0 if pattern.search(getattr(s, "typename", type(s)).__name__) else 0.0
                for s in self.specs
            ]
        raise ConfigError(
            f"partition_method={method!r} is unknown; use 'parameters', 'uniform' or "
            "'type:REGEX' (layers whose class name matches are balanced)"
        )

    def _first_index(self, key: str) -> int:
        return next(i for i, s in enumerate(self.specs) if getattr(s, "key", None) == key)

    def _layer(self, i: int) -> tuple[Any, Callable]:
        spec = self.specs[i]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed + self._first_index(spec.key))
                    self.tied_modules[spec.key] = spec.build()
            mod = self.tied_modules[spec.key]
            fn = (lambda x, m=mod, f=spec.forward_fn: f(m, x)) if spec.forward_fn else mod
            return mod, fn
        if isinstance(spec, LayerSpec):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + i)
                mod = spec.build()
            self.layers[str(i)] = mod
            return mod, mod
        if isinstance(spec, nn.Module):
            self.layers[str(i)] = spec
            return spec, spec
        if callable(spec):
            return None, spec
        raise ConfigError(f"layers[{i}] = {spec!r} is not a LayerSpec, nn.Module or callable")

    def _tied_holders(self) -> tuple[dict[str, tuple[int, ...]], dict[str, nn.Parameter]]:
        ranks: dict[str, set[int]] = {}
        for k in range(self.num_stages):
            for i in range(self.bounds[k], self.bounds[k + 1]):
                key = getattr(self.specs[i], "key", None)
                if key is not None:
                    ranks.setdefault(key, set()).add(k % self.pp)
        holders = {
            f"tied_modules.{key}.{n}": tuple(sorted(rs))
            for key, rs in ranks.items()
            if len(rs) > 1
            for n, _ in self._meta_tied(key)
        }
        mine = {n: p for n, p in self.named_parameters() if n.startswith("tied_modules.")}
        return holders, mine

    def _meta_tied(self, key: str):
        with torch.device("meta"):
            return list(self.specs[self._first_index(key)].build().named_parameters())

    def tensor_parallel_plan(self):
        """The tensor-parallel plan of this rank's layers: each transformer block of a
        known kind inside a layer is sharded by its family's rows, everything else stays
        replicated (``parallel.tensor.layer_plans``). Tied layers are not sharded."""
        from meshtrain.parallel.tensor.layer_plans import layers_plan

        return layers_plan({f"layers.{k}": m for k, m in self.layers.items()})

    # ---- running -----------------------------------------------------------------------
    def forward(self, x):
        """All layers in sequence (only meaningful when this rank holds every stage)."""
        if len(self.stages) != self.num_stages:
            raise ConfigError(
                "PipelineModule.forward runs the whole model; with pp > 1 call "
                "engine.train_batch / eval_batch so the stages run in a schedule"
            )
        for k in range(self.num_stages):
            for call in self.stages[k]._calls:
                x = call(x)
        return x
