"""``apply_tensor_parallel``: rewrite a model in place according to its plan.

What a rank holds afterwards (``T`` = tensor-parallel size, ``P`` = padded): ``1/T`` of
every column/row weight and of the (padded) vocabulary; replicated norms, biases of row
layers and anything the plan does not name. What moves per transformer block (decoder /
Llama layout, ``x`` = ``[batch, seq, hidden]`` activation of ``b`` bytes, ``comm``'s
recorded bytes; ``w`` = bytes of one norm weight's gradient):

====================  ====================================  =====================================
                      forward                               backward
====================  ====================================  =====================================
plain TP              2 all-reduce (attention out, MLP      2 all-reduce (attention in, MLP in)
                      out): 2 calls, 4 b                    2 calls, 4 b
sequence parallel     2 all-gather (region entries) +       2 reduce-scatter + 2 all-gather
                      2 reduce-scatter (row outputs):       = 4 b, plus 2 all-reduce of the
                      4 calls, 4 b                          norm gradients (4 w): 6 calls
====================  ====================================  =====================================

Outside the blocks: the vocab-parallel embedding all-reduces (sequence parallel:
reduce-scatters) its output in forward; the LM head's input is all-reduced
(sequence parallel: reduce-scattered) in backward; the vocab-parallel loss adds two small
all-reduces (``cross_entropy``). Head counts T does not divide are padded with zero heads;
under grouped-query attention the key/value heads are padded to a multiple of T and the
query heads with them, a whole group of ``heads / kv_heads`` zero query heads per zero
key/value head, so every query head keeps its key/value head. Vocabularies and MLP widths
are padded to a multiple of T. Padding units are zero and stay zero (``sharding``).

A mixture-of-experts block (router, experts, shared experts) is left whole whatever the
plan's rows say: it runs replicated on every tp rank, its experts sharded over ep, not tp
(``moe_blocks``, which gives its bytes and gradients).

Under sequence parallelism, modules the plan marks ``sequence`` (norms, dropout) run on
this rank's tokens: dropout inside them draws from the per-rank stream (``rng``), like
dropout inside regions, and their weights' gradients are summed over the tp group.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from typing import Any

import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.tensor import mappings as M
from meshtrain.parallel.tensor import plans
from meshtrain.parallel.tensor.cross_entropy import (
    HFLoss,
    causal_lm_loss,
    recompute_masked_lm_loss,
)
from meshtrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_conv1d,
)
from meshtrain.parallel.tensor.moe_blocks import inside as in_moe_block
from meshtrain.parallel.tensor.moe_blocks import match_rows, moe_blocks
from meshtrain.parallel.tensor.restore import Changes
from meshtrain.parallel.tensor.rng import RegionRNG

log = logging.getLogger("meshtrain.tensor_parallel")
_REPLACING = ("embedding", "embedding_to_sequence", "column", "row", "lm_head")


def apply_tensor_parallel(
    model: nn.Module,
    topology: Any,
    config: Any = None,
    plan: plans.TPPlan | None = None,
    *,
    sequence_parallel: bool | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Shard ``model`` over ``topology.tp_group`` following ``plan``; returns ``model``.

    ``config``: a ``meshtrain.config.Config`` (its ``tensor_parallel`` section gives
    ``sequence_parallel`` and an optional plan) or None. ``plan``: defaults to the built-in
    plan for the model's class (``plans.PLANS``). ``seed``: base of the per-rank region
    random streams (default ``torch.initial_seed()``, equal on ranks seeded alike).
    """
    group = topology.tp_group
    t = group.size
    section = getattr(config, "tensor_parallel", None)
    if sequence_parallel is None:
        sequence_parallel = bool(getattr(section, "sequence_parallel", False))
    if plan is None and getattr(section, "plan", None):
        plan = plans.TPPlan.from_dict(section.plan)
    plan = plan or plans.plan_for(model)
    if plan is None:
        raise ConfigError(plans.no_plan_message(model))
    if sequence_parallel:
        plans.check_sequence_parallel(plan)
    sizes = {k: int(_lookup(model, path, plan.name)) for k, path in plan.sizes.items()}
    _log_padding(sizes, t, plan.name, topology)

    modules = dict(model.named_modules())
    # mixture-of-experts blocks stay whole, replicated over tp (``moe_blocks``; under
    # sequence parallelism ``parallelize`` sums their gradients over tp after EP)
    moe = moe_blocks(model)
    matched, excused = match_rows(modules, plan.rows, moe)
    # a gather_sequence row only matters under sequence parallelism (BertModel's pooler
    # may be absent)
    empty = [
        row[0]
        for row, names in matched.items()
        if not names
        and row[0] not in excused
        and (sequence_parallel or row[1] != "gather_sequence")
    ]
    if empty:
        raise ConfigError(
            f"tensor-parallel plan {plan.name!r}: no module of {type(model).__name__} matches "
            f"{empty}; module names look like {plans.sample_names(model)}"
        )
    _check_overlaps(matched, plan.name)
    regions = [n for row, names in matched.items() if row[1] == "region" for n in names]
    rng = RegionRNG(_seed(seed, group.rank), topology.device)
    shared: dict[int, nn.Parameter] = {}  # tied weights are sharded once
    # after a gather_sequence the full sequence reaches the LM head
    head_sp = sequence_parallel and not any(row[1] == "gather_sequence" for row in plan.rows)
    reduced: set[int] = set()  # replicated parameters whose gradients are summed over tp
    changes = Changes()  # what remove_tensor_parallel undoes (``restore``)
    hooks = changes.handles
    for row, names in matched.items():
        style, units_key = row[1], row[2] if len(row) > 2 else None
        blocks = row[3] if len(row) > 3 else 1
        units = sizes[units_key] if units_key else None
        for name in names:
            mod = modules[name]
            inside = next((r for r in regions if name.startswith(r + ".")), None)
            sp = head_sp if style == "lm_head" else sequence_parallel
            new = _build(mod, style, group, units, blocks, sp, inside, shared)
            if new is not None:
                parent, _, child = name.rpartition(".")
                changes.replace(model.get_submodule(parent) if parent else model, child, new)
                if style == "row" and inside is not None:
                    hooks.append(new.register_forward_pre_hook(lambda *_: rng.exit()))
            elif style == "region":
                hooks.extend(_enter_region(mod, group, sequence_parallel, rng))
            elif style == "scatter_sequence" and sequence_parallel:
                scatter = functools.partial(M.scatter_to_region, group=group, dim=1)
                hooks.append(_on_input(mod, scatter))
            elif style == "gather_sequence" and sequence_parallel:
                gather = functools.partial(M.gather_from_region, group=group, dim=1)
                hooks.append(_on_input(mod, gather))
            elif style == "sequence" and sequence_parallel and t > 1:
                hooks.extend(_on_sequence_shard(mod, group, rng, reduced))
            elif style == "per_head" and t > 1:
                hooks.extend(_sum_grads_over(mod, group, reduced))
    for path, attr, units_key in plan.attrs:
        n = sizes[units_key]
        local = -(-n // t)  # padded units per rank
        for name, mod in model.named_modules():
            if (
                fnmatch.fnmatchcase(name, path)
                and hasattr(mod, attr)
                and not in_moe_block(name, moe)
            ):
                changes.set_attr(mod, attr, getattr(mod, attr) * local // n)
    _repoint_aliases(model, shared, changes)
    _set_loss(model, plan, group, sizes, changes)
    _full_logits_in_generate(model, plan, sequence_parallel, changes)
    info = {"plan": plan.name, "size": t, "sequence_parallel": sequence_parallel, "group": group}
    changes.set_attr(model, "meshtrain_tp", info)  # group: for pipeline.router_aux's sums
    # parameters a caller collected before (an optimizer's groups) -> their shards
    changes.set_attr(model, "meshtrain_tp_replaced", shared)
    changes.set_attr(model, "meshtrain_tp_changes", changes)
    return model


def remap_parameters(model_parameters, model: nn.Module):
    """``model_parameters`` (params or torch-style groups, taken before
    ``apply_tensor_parallel``) with each replaced parameter swapped for its shard."""
    if model_parameters is None:
        return None
    replaced: dict[int, nn.Parameter] = getattr(model, "meshtrain_tp_replaced", {})
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**g, "params": [replaced.get(id(p), p) for p in g["params"]]} for g in items]
    return [replaced.get(id(p), p) for p in items]


# ----------------------------------------------------------------------------- building


def _build(mod, style, group, units, blocks, sp, inside, shared):
    kw = {"sequence_parallel": sp, "shared": shared}
    if style in ("embedding", "embedding_to_sequence"):
        if not isinstance(mod, nn.Embedding):
            raise ConfigError(f"{style!r} style needs nn.Embedding, got {type(mod).__name__}")
        kw["sequence_parallel"] = sp and style == "embedding_to_sequence"
        return VocabParallelEmbedding.from_module(mod, group, **kw)
    if style in ("column", "row", "lm_head"):
        if not (isinstance(mod, nn.Linear) or is_conv1d(mod)):
            raise ConfigError(
                f"{style!r} style needs nn.Linear or Conv1D, got {type(mod).__name__}"
            )
        if style == "row":
            return RowParallelLinear.from_module(mod, group, units=units, blocks=blocks, **kw)
        return ColumnParallelLinear.from_module(
            mod, group, units=units, blocks=blocks, input_is_parallel=inside is not None, **kw
        )
    return None


def _enter_region(mod: nn.Module, group, sp: bool, rng: RegionRNG) -> list:
    enter = (
        functools.partial(M.gather_from_sequence, group=group)
        if sp
        else functools.partial(M.copy_to_region, group=group)
    )

    return [
        _on_input(mod, enter, before=rng.enter),
        mod.register_forward_hook(lambda *_: rng.exit()),
    ]


def _sum_grads_over(mod: nn.Module, group, reduced: set[int]) -> list:
    """``mod`` runs on this rank's share of the work (its tokens, its heads): its
    replicated weights' gradients are partial sums, summed over the group (once each)."""
    handles = []
    for p in mod.parameters():
        if p.requires_grad and id(p) not in reduced:
            reduced.add(id(p))
            handles.append(p.register_hook(M.reduce_gradient_hook(group)))
    return handles


def _on_sequence_shard(mod: nn.Module, group, rng: RegionRNG, reduced: set[int]) -> list:
    """``mod`` runs on this rank's tokens: its replicated weights' gradients cover those
    tokens only (summed over the group), and its dropout must not repeat another rank's
    mask on different tokens (this rank's region stream)."""
    handles = _sum_grads_over(mod, group, reduced)
    if not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in mod.modules()):
        return handles
    entered: list[bool] = []

    def enter(*_):
        entered.append(not rng.inside)  # nested in a region: already on the stream
        rng.enter()

    def leave(*_):
        if entered.pop():
            rng.exit()

    return [*handles, mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]


def _repoint_aliases(model: nn.Module, shared: dict[int, nn.Parameter], changes: Changes) -> None:
    """Point every other reference to a replaced parameter at its shard (BertForMaskedLM's
    ``cls.predictions.bias`` is ``decoder.bias``), with the shard's spec, so the model
    holds no stale full copy and ``full_state_dict`` unshards every key."""
    specs = {
        id(getattr(m, name)): spec for m in model.modules() for name, spec in _specs(m).items()
    }
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in shared:
                new = shared[id(p)]
                changes.aliases.append((mod, name, p))
                mod._parameters[name] = new
                changes.set_attr(mod, "tp_specs", {**_specs(mod), name: specs[id(new)]})


def _specs(mod: nn.Module) -> dict:
    return getattr(mod, "tp_specs", {})


def _on_input(mod: nn.Module, fn, before=None):
    """Apply ``fn`` to the module's first input (positional, or ``hidden_states=``)."""

    def pre(_mod, args, kwargs):
        if before is not None:
            before()
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise TypeError(f"{type(_mod).__name__}: expected its input first or as hidden_states")

    return mod.register_forward_pre_hook(pre, with_kwargs=True)


def _set_loss(model: nn.Module, plan: plans.TPPlan, group, sizes: dict[str, int], changes) -> None:
    if plan.loss is None:
        return
    vocab = sizes["vocab"]
    if plan.loss == "decoder":
        loss = functools.partial(causal_lm_loss, group=group, vocab_size=vocab)
        changes.set_attr(model, "loss_fn", loss)
    elif plan.loss in ("hf_causal", "hf_masked"):
        loss = HFLoss(group, vocab, causal=plan.loss == "hf_causal")
        changes.set_attr(model, "loss_function", loss)
    elif plan.loss == "masked_lm":
        changes.handles.extend(recompute_masked_lm_loss(model, group, vocab))
    else:
        raise ConfigError(f"plan {plan.name!r}: unknown loss {plan.loss!r}")


def _full_logits_in_generate(model: nn.Module, plan: plans.TPPlan, sp: bool, changes) -> None:
    """``model.generate`` reads ``logits[:, -1]`` over the whole vocabulary: while it runs
    the LM head all-gathers its vocabulary shards (every tp rank must call it alike)."""
    original = getattr(model, "generate", None)
    heads = [
        m
        for n, m in model.named_modules()
        for row in plan.rows
        if row[1] == "lm_head" and fnmatch.fnmatchcase(n, row[0])
    ]
    if original is None or not heads:
        return

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if sp:
            raise ConfigError(
                "generate() under tensor_parallel.sequence_parallel: decoding one token at a "
                "time cannot split the sequence over the tp ranks; apply tensor parallelism "
                "with sequence_parallel false for generation (checkpoints load either way)"
            )
        for head in heads:
            head.gather_output = True
        try:
            return original(*args, **kwargs)
        finally:
            for head in heads:
                head.gather_output = False

    changes.set_attr(model, "generate", generate)


# ----------------------------------------------------------------------------- checks


def _lookup(model: nn.Module, path: str, plan: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"tensor-parallel plan {plan!r}: the model has no {path!r}")
        obj = getattr(obj, part)
    return obj


def _check_overlaps(matched: dict, plan: str) -> None:
    """Two rows that both replace one module would shard it twice (from the original)."""
    owner: dict[str, str] = {}
    for row, names in matched.items():
        if row[1] not in _REPLACING:
            continue
        for name in names:
            if name in owner:
                raise ConfigError(
                    f"tensor-parallel plan {plan!r}: rows {owner[name]!r} and {row[0]!r} both "
                    f"match {name!r}; make one pattern narrower (e.g. '*[0-9].output')"
                )
            owner[name] = row[0]


def _log_padding(sizes: dict[str, int], t: int, plan: str, topology) -> None:
    if getattr(topology, "rank", 0) != 0:
        return
    heads, kv = sizes.get("heads"), sizes.get("kv_heads")
    for key in ("vocab", "heads", "kv_heads"):
        n = sizes.get(key)
        if n is None or not n % t or (key == "kv_heads" and kv == heads):
            continue
        if key == "heads" and kv is not None and kv != heads:
            continue  # grouped-query attention: the query heads follow their kv heads
        padded = -(-n // t) * t
        also = ""
        if key == "kv_heads" and heads is not None and kv != heads:
            also = f" (and the query heads {heads} to {padded * (heads // kv)})"
        log.info(
            "tensor parallel (%s): %s %d padded to %d%s, a multiple of tp %d; "
            "checkpoints and module_state_dict() keep the unpadded %d",
            plan,
            key,
            n,
            padded,
            also,
            t,
            n,
        )


def _seed(seed: int | None, tp_rank: int) -> int:
    base = torch.initial_seed() if seed is None else seed
    return (base + 2718 + tp_rank) % (2**63)


__all__ = ["apply_tensor_parallel", "remap_parameters"]
