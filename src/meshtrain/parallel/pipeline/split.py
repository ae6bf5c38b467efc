"""Cutting a model whose blocks sit in one ``nn.ModuleList`` into pipeline stages.

A ``Layout`` (``meshtrain.families.layout``) names, for a model family, the block list,
the modules only the first stage runs (embeddings) and the modules only the last stage
runs (final norm, head; the loss is the model's own, computed where the labels go). Each
family's room declares its layout (``meshtrain.families``); ``LAYOUTS`` holds them in room
order: meshtrain's reference decoder, ``transformers`` Llama-style (``model.layers``),
GPT-2 (``transformer.h``) and BERT (``bert.encoder.layer``); pass your own ``Layout`` for
other models.

Stage ``k`` of ``S`` runs the model's own ``forward`` on a shallow copy of the module tree
in which (1) the block list holds only blocks ``[a_k, b_k)``, (2) on stages after the
first the embedding returns the activation received from stage ``k - 1`` (the dummy
``input_ids`` it is called with only carry the shape) and position embeddings add
nothing; under sequence parallelism a received ``1/T`` sequence shard goes to the stage's
first block instead, the embedding's stand-in returning a full-length placeholder so
that positions, rotary tables and masks follow the whole sequence, (3) on stages before
the last the head modules are the identity, so the "logits" the model returns are the
hidden states to send on. Blocks, embeddings and head are the user's own modules:
nothing is copied, parameter names stay the model's names. Parameters of blocks on other
ranks can be freed (``free_unused``).

Balancing (contiguous cuts, each stage at least one block): ``"parameters"`` minimises
the largest stage's parameter count (embedding counted on the first stage, head on the
last), ``"uniform"`` the largest block count, or ``cut_points`` names the first block of
each stage after the first. A parameter two stages on different ranks both use (GPT-2's
tied input embedding and LM head) gets its own group (``pipeline.tied``) so its gradient
can be summed over the ranks holding it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.families.layout import Layout
from meshtrain.families.rooms import layouts
from meshtrain.parallel.pipeline.stand_ins import Input, KeepShard, Zero, replace_first_input

LAYOUTS: tuple[Layout, ...] = layouts()  # the rooms' layouts, in room order


def _get(root: nn.Module, path: str) -> nn.Module | None:
    mod: nn.Module | None = root
    for part in path.split("."):
        mod = getattr(mod, part, None) if mod is not None else None
    return mod if isinstance(mod, nn.Module) else None


def known_layout(model: nn.Module) -> Layout | None:
    """The first known ``Layout`` whose block list and input embedding exist in ``model``,
    or None."""
    for layout in LAYOUTS:
        inputs = [p for p, role in layout.first.items() if role == "input"]
        if isinstance(_get(model, layout.blocks), nn.ModuleList) and all(
            _get(model, p) is not None for p in inputs
        ):
            return layout
    return None


def find_layout(model: nn.Module) -> Layout:
    """The first known ``Layout`` whose block list and input embedding exist in ``model``."""
    layout = known_layout(model)
    if layout is not None:
        return layout
    raise ConfigError(
        f"cannot split {type(model).__name__} into pipeline stages automatically: no block "
        f"list at any of {[lay.blocks for lay in LAYOUTS]}; pass layout=Layout(blocks=..., "
        "first=..., last=...) or build the model with meshtrain.pipe.PipelineModule"
    )


def partition(weights: Sequence[float], parts: int, extra_first=0.0, extra_last=0.0) -> list[int]:
    """Bounds ``[0, c_1, ..., len(weights)]`` of ``parts`` contiguous non-empty ranges that
    minimise the largest range's weight sum (``extra_*`` added to the first/last range)."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ConfigError(
            f"cannot cut {n} layers into {parts} pipeline stages; need 1 <= stages <= layers"
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def cost(i: int, j: int, k: int) -> float:
        return (
            prefix[j]
            - prefix[i]
            + (extra_first if k == 0 else 0.0)
            + (extra_last if k == parts - 1 else 0.0)
        )

    inf = float("inf")
    # best[k][j]: smallest max-cost of the first j layers in k + 1 ranges; cut[k][j]: start
    best = [[inf] * (n + 1) for _ in range(parts)]
    cut = [[0] * (n + 1) for _ in range(parts)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for k in range(1, parts):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                c = max(best[k - 1][i], cost(i, j, k))
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    bounds = [n]
    for k in range(parts - 1, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return [0] + bounds[::-1]


def bounds_from_cuts(cut_points: Sequence[int], n: int, parts: int) -> list[int]:
    bounds = [0, *cut_points, n]
    if len(cut_points) != parts - 1 or any(
        a >= b for a, b in zip(bounds, bounds[1:], strict=False)
    ):
        raise ConfigError(
            f"pipeline cut_points={list(cut_points)} must be {parts - 1} increasing block "
            f"indices strictly between 0 and {n} (the first block of stages 1..{parts - 1})"
        )
    return bounds


def _rewire(root: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``root`` with the modules at ``replace``'s paths swapped; every
    module on those paths is copied (own child dict), everything else is shared."""
    new_root = copy.copy(root)
    new_root._modules = dict(root._modules)
    for path, module in replace.items():
        *parents, leaf = path.split(".")
        node = new_root
        for part in parents:
            child = copy.copy(node._modules[part])
            child._modules = dict(child._modules)
            node._modules[part] = child
            node = child
        node._modules[leaf] = module
    return new_root


class SplitStage(nn.Module):
    """Stage ``index`` of ``num_stages``: calls the model's forward on its rewired copy.

    ``sequence_parallel``: the tensor-parallel plan scatters the sequence (Megatron's
    sequence parallelism), so a later stage may receive this tp rank's ``1/T`` sequence
    shard ``[b, t/T, d]`` instead of ``[b, t, d]`` (see ``forward``)."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        index: int,
        num_stages: int,
        blocks,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.sequence_parallel = sequence_parallel
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        # the last stage returns the model's whole outputs (loss, logits, ...) instead of
        # its loss: ``PipelineRuntime.eval_outputs`` sets it around an evaluation
        self.whole_outputs = False
        # a MoE model's router auxiliary loss across stages (``router_aux``), set by
        # ``attach_router_aux``; None for a model without one
        self.router_aux = None
        self._input = Input()
        full = _get(model, layout.blocks)
        replace: dict[str, nn.Module] = {layout.blocks: nn.ModuleList(full[i] for i in blocks)}
        if not self.is_first:
            roles = {"input": self._input, "zero": Zero(), "identity": nn.Identity()}
            replace.update({p: roles[r] for p, r in layout.first.items() if _get(model, p)})
        if not self.is_last:
            replace.update({p: nn.Identity() for p in layout.last if _get(model, p) is not None})
        self._keep = None  # ``Layout.reshapes_after``'s stand-in, under SP before the last
        if sequence_parallel and not self.is_last and layout.reshapes_after in replace:
            self._keep = KeepShard()
            replace[layout.reshapes_after] = self._keep
        self.model = _rewire(model, replace)
        # stages before the last run only the backbone: no task head, no pooling (a
        # path, not a module attribute, so the backbone's parameters are not registered
        # twice)
        self.body = None if self.is_last else layout.body
        self.block_ids, self.blocks_path = tuple(blocks), layout.blocks
        # the model's own parameter names (shared modules keep them)
        ids: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            ids.setdefault(id(p), n)
        self.names = {ids[id(p)]: p for p in self.model.parameters()}

    def model_key(self, key: str) -> str:
        """The unsplit model's state-dict key of this stage's ``key`` (checkpoints use it):
        ``model.`` dropped, blocks renumbered back (``layers.0.w`` on a stage whose first
        block is 4 is ``layers.4.w``); every other module keeps its path."""
        key = key.removeprefix("model.")
        head = self.blocks_path + "."
        if key.startswith(head):
            j, rest = key[len(head) :].split(".", 1)
            key = f"{head}{self.block_ids[int(j)]}.{rest}"
        return key

    def forward(self, x: torch.Tensor | None, batch) -> torch.Tensor:
        """``x``: the previous stage's activation (None on stage 0); ``batch``: the
        micro-batch as the user gives it (dict, or tuple ``(input_ids, labels)``)."""
        if isinstance(batch, dict):
            kwargs = dict(batch)
            labels = kwargs.pop("labels", None)
            ids = kwargs.pop("input_ids")
            args: tuple = ()
        else:
            ids, labels, kwargs = batch[0], (batch[1] if len(batch) > 1 else None), {}
            args = ()
        swap = None
        aux, sums = self.router_aux, None
        if aux is not None:
            x, sums = aux.begin(x)  # the hidden states and the earlier stages' router sums
            kwargs.update(aux.model_kwargs())
        if not self.is_first:
            self._input.value = x
            # the batch's own ids, not x's shape: under sequence parallelism x holds 1/T
            # of the sequence, while positions (rotary tables, masks) follow the full
            # length; and a sequence classifier's head finds each row's last non-padding
            # token in them. The embedding's stand-in ignores them.
            ids = ids.to(x.device)
            if self.sequence_parallel and x.dim() > 2 and x.shape[1] != ids.shape[1]:
                # x is a sequence shard, but a transformers model derives its position
                # ids, rotary tables and masks from its embedding's output length: the
                # stand-in returns a full-length zero-stride placeholder (no storage), and
                # the stage's first block takes x in its place (a hook outside any
                # activation checkpoint, so a recomputation sees x too)
                self._input.value = x.new_zeros(()).expand(*ids.shape[:2], *x.shape[2:])
                first = _get(self.model, self.blocks_path)[0]
                swap = first.register_forward_pre_hook(replace_first_input(x), with_kwargs=True)
        if self.is_last and labels is not None:
            kwargs["labels"] = labels
        if self._keep is not None:
            self._keep.length = ids.shape[1]
        try:
            runner = _get(self.model, self.body) if self.body else None
            out = (runner or self.model)(*args, input_ids=ids, **kwargs)
        finally:
            self._input.value = None
            if swap is not None:
                swap.remove()
        if self._keep is not None and self._keep.value is not None:
            out, self._keep.value = self._keep.value, None  # the shard, not the placeholder
        if aux is not None:
            return self._with_aux(out, aux, sums, labels, kwargs.get("attention_mask"))
        if isinstance(out, torch.Tensor) or (self.is_last and self.whole_outputs):
            return out
        key = "loss" if self.is_last and labels is not None else "logits"
        return out[key] if key in out else out[0]

    def _with_aux(self, out, aux, sums, labels, attention_mask):
        """The model's output with the router auxiliary loss (``router_aux``): a stage
        before the last sends its hidden states with the running router sums; the last
        adds ``coef x aux`` of every layer to the model's loss."""
        if not self.is_last:
            hidden = out if isinstance(out, torch.Tensor) else out[0]
            return aux.send(hidden, sums, attention_mask)
        if labels is None:  # no loss to add it to (the model's outputs, unchanged)
            aux.discard()
            if isinstance(out, torch.Tensor) or self.whole_outputs:
                return out
            return out["logits"] if "logits" in out else out[0]
        value = aux.aux(sums, attention_mask)
        extra = aux.spec["coef"] * value
        if isinstance(out, torch.Tensor):
            return out + extra.to(out.device)
        out["loss"] = out["loss"] + extra.to(out["loss"].device)
        if self.whole_outputs:
            out["aux_loss"] = value  # as the model's own outputs carry it
            return out
        return out["loss"]


def split_model(
    model: nn.Module,
    num_stages: int,
    *,
    method: str = "parameters",
    cut_points: Sequence[int] | None = None,
    layout: Layout | None = None,
    sequence_parallel: bool = False,
) -> list[SplitStage]:
    """All ``num_stages`` stages of ``model`` (cheap: modules are shared, not copied);
    ``sequence_parallel``: the model's tensor-parallel plan scatters the sequence."""
    layout = layout or find_layout(model)
    blocks = _get(model, layout.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(
            f"layout.blocks={layout.blocks!r} is {type(blocks).__name__}, not an nn.ModuleList "
            f"in {type(model).__name__}; name the module list that holds the blocks"
        )
    n = len(blocks)
    if cut_points is not None:
        bounds = bounds_from_cuts(cut_points, n, num_stages)
    elif method == "uniform":
        bounds = partition([1] * n, num_stages)
    elif method == "parameters":

        def count(mods) -> int:
            return sum(p.numel() for p in {id(p): p for m in mods for p in m.parameters()}.values())

        first = [m for p in layout.first if (m := _get(model, p)) is not None]
        last = [m for p in layout.last if (m := _get(model, p)) is not None]
        bounds = partition([count([b]) for b in blocks], num_stages, count(first), count(last))
    else:
        raise ConfigError(
            f"pipeline.partition_method={method!r} is unknown for automatic splitting; use "
            "'parameters', 'uniform' or give cut_points"
        )
    return [
        SplitStage(model, layout, k, num_stages, range(bounds[k], bounds[k + 1]), sequence_parallel)
        for k in range(num_stages)
    ]


def free_unused(model: nn.Module, kept: Sequence[nn.Module]) -> int:
    """Release the storage of ``model``'s parameters no kept stage uses; returns elements
    freed. The model must not run whole afterwards (its other blocks are empty)."""
    keep = {id(p) for s in kept for p in s.parameters()}
    freed = 0
    for p in model.parameters():
        if id(p) not in keep and p.numel():
            freed += p.numel()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return freed
