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
all-reduces (``cross_entropy``). Head counts T does not divide are padded with zero heads
(multi-head attention) or refused (grouped-query attention, whose query-to-key/value
grouping padding would break); vocabularies and MLP widths are padded to a multiple of T.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from typing import Any

import torch
from torch import nn

from meshtrain.errors import ConfigError, TopologyError
from meshtrain.parallel.tensor import mappings as M
from meshtrain.parallel.tensor.cross_entropy import HFLoss, causal_lm_loss
from meshtrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_conv1d,
)
from meshtrain.parallel.tensor.plans import TPPlan, plan_for
from meshtrain.parallel.tensor.rng import RegionRNG

log = logging.getLogger("meshtrain.tensor_parallel")


def apply_tensor_parallel(
    model: nn.Module,
    topology: Any,
    config: Any = None,
    plan: TPPlan | None = None,
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
        plan = TPPlan.from_dict(section.plan)
    plan = plan or plan_for(model)
    if plan is None:
        raise ConfigError(_no_plan_message(model))
    if sequence_parallel and not plan.sequence_parallel:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel: the {plan.name!r} plan does not support "
            "sequence parallelism (supported: the meshtrain decoder and Llama/Qwen2/Mistral); "
            "set it to false"
        )
    sizes = {k: int(_lookup(model, path, plan.name)) for k, path in plan.sizes.items()}
    _check_heads(sizes, t, plan.name)
    _log_padding(sizes, t, plan.name, topology)

    modules = dict(model.named_modules())
    matched = {row: [n for n in modules if fnmatch.fnmatchcase(n, row[0])] for row in plan.rows}
    empty = [row[0] for row, names in matched.items() if not names]
    if empty:
        raise ConfigError(
            f"tensor-parallel plan {plan.name!r}: no module of {type(model).__name__} matches "
            f"{empty}; module names look like {_sample_names(model)}"
        )
    regions = [n for row, names in matched.items() if row[1] == "region" for n in names]
    rng = RegionRNG(_seed(seed, group.rank), topology.device)
    shared: dict[int, nn.Parameter] = {}  # tied weights are sharded once
    for row, names in matched.items():
        style, units_key = row[1], row[2] if len(row) > 2 else None
        blocks = row[3] if len(row) > 3 else 1
        units = sizes[units_key] if units_key else None
        for name in names:
            mod = modules[name]
            inside = next((r for r in regions if name.startswith(r + ".")), None)
            new = _build(mod, style, group, units, blocks, sequence_parallel, inside, shared)
            if new is not None:
                _replace(model, name, new)
                if style == "row" and inside is not None:
                    new.register_forward_pre_hook(lambda *_: rng.exit())
            elif style == "region":
                _enter_region(mod, group, sequence_parallel, rng)
            elif style == "scatter_sequence" and sequence_parallel:
                _on_input(mod, functools.partial(M.scatter_to_region, group=group, dim=1))
            elif style == "sequence" and sequence_parallel and t > 1:
                for p in mod.parameters(recurse=False):
                    p.register_hook(M.reduce_gradient_hook(group))
    for path, attr, units_key in plan.attrs:
        n = sizes[units_key]
        local = -(-n // t)  # padded units per rank
        for name, mod in model.named_modules():
            if fnmatch.fnmatchcase(name, path) and hasattr(mod, attr):
                setattr(mod, attr, getattr(mod, attr) * local // n)
    _set_loss(model, plan, group, sizes)
    model.meshtrain_tp = {"plan": plan.name, "size": t, "sequence_parallel": sequence_parallel}
    # parameters a caller collected before (an optimizer's groups) -> their shards
    model.meshtrain_tp_replaced = shared
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


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _enter_region(mod: nn.Module, group, sp: bool, rng: RegionRNG) -> None:
    enter = (
        functools.partial(M.gather_from_sequence, group=group)
        if sp
        else functools.partial(M.copy_to_region, group=group)
    )

    _on_input(mod, enter, before=rng.enter)
    mod.register_forward_hook(lambda *_: rng.exit())


def _on_input(mod: nn.Module, fn, before=None) -> None:
    """Apply ``fn`` to the module's first input (positional, or ``hidden_states=``)."""

    def pre(_mod, args, kwargs):
        if before is not None:
            before()
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise TypeError(f"{type(_mod).__name__}: expected its input first or as hidden_states")

    mod.register_forward_pre_hook(pre, with_kwargs=True)


def _set_loss(model: nn.Module, plan: TPPlan, group, sizes: dict[str, int]) -> None:
    if plan.loss is None:
        return
    vocab = sizes["vocab"]
    if plan.loss == "decoder":
        model.loss_fn = functools.partial(causal_lm_loss, group=group, vocab_size=vocab)
    elif plan.loss in ("hf_causal", "hf_masked"):
        model.loss_function = HFLoss(group, vocab, causal=plan.loss == "hf_causal")
    else:
        raise ConfigError(f"plan {plan.name!r}: unknown loss {plan.loss!r}")


# ----------------------------------------------------------------------------- checks


def _lookup(model: nn.Module, path: str, plan: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"tensor-parallel plan {plan!r}: the model has no {path!r}")
        obj = getattr(obj, part)
    return obj


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_heads(sizes: dict[str, int], t: int, plan: str) -> None:
    heads, kv = sizes.get("heads"), sizes.get("kv_heads")
    if kv is None or kv == heads or heads is None:
        return  # multi-head attention: zero heads pad any T
    if heads % t or kv % t:
        import math

        valid = _divisors(math.gcd(heads, kv))
        raise TopologyError(
            f"tensor_parallel_size {t} does not divide the {plan} model's {heads} query heads "
            f"and {kv} key/value heads (grouped-query attention cannot be padded without "
            f"changing which keys each query reads); use a tensor_parallel_size in {valid}"
        )


def _log_padding(sizes: dict[str, int], t: int, plan: str, topology) -> None:
    if getattr(topology, "rank", 0) != 0:
        return
    for key in ("vocab", "heads", "kv_heads"):
        n = sizes.get(key)
        if n is not None and n % t and not (key == "kv_heads" and n == sizes.get("heads")):
            padded = -(-n // t) * t
            log.info(
                "tensor parallel (%s): %s %d padded to %d (a multiple of tp %d); "
                "checkpoints and module_state_dict() keep the unpadded %d",
                plan,
                key,
                n,
                padded,
                t,
                n,
            )


def _seed(seed: int | None, tp_rank: int) -> int:
    base = torch.initial_seed() if seed is None else seed
    return (base + 2718 + tp_rank) % (2**63)


def _sample_names(model: nn.Module, limit: int = 12) -> list[str]:
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) or is_conv1d(m)
    ]
    return names[:limit] + (["..."] if len(names) > limit else [])


def _no_plan_message(model: nn.Module) -> str:
    names = _sample_names(model, limit=16)
    return (
        f"tensor parallelism has no plan for {type(model).__name__} (built-in plans: the "
        f"meshtrain decoder, Llama/Qwen2/Mistral, GPT-2, BERT). Its linear and embedding "
        f"modules are: {', '.join(names)}. Write a plan naming them, e.g.\n"
        "    from meshtrain.parallel.tensor import TPPlan\n"
        "    plan = TPPlan(name='mine', sizes={'heads': 'config.n_heads'}, rows=(\n"
        "        ('blocks.*.attn', 'region'),\n"
        "        ('blocks.*.attn.q_proj', 'column', 'heads'), ... ,\n"
        "        ('blocks.*.attn.out_proj', 'row', 'heads'),\n"
        "        ('blocks.*.mlp.up', 'column'), ('blocks.*.mlp.down', 'row')))\n"
        "and pass it as meshtrain.initialize(..., tp_plan=plan) or apply_tensor_parallel("
        "model, topology, config, plan=plan) (see docs/tensor_parallel.md)"
    )


__all__ = ["apply_tensor_parallel", "remap_parameters"]
