"""``apply_context_parallel(model, topology, config)``: step 2 of ``parallelize``.

What it changes (no parameter: a checkpoint is the same at any C):

Which models, and how, is their room's (``meshtrain.families``):

* a room with ``context_attention`` (meshtrain's ``Decoder``): each module of those
  classes (``Attention``) gets one ``ContextParallel`` as its ``context`` (the seam in
  ``components/attention.py`` calls ``context.attend``);
* a room whose ``context_types`` hold the model's ``model_type`` (transformers Llama,
  Qwen2, Mistral, GPT-2 and Mixtral: ``FAMILIES``): each attention layer gets the context
  as ``meshtrain_context`` and the model's attention implementation becomes
  ``transformers_attention.ATTN_NAME``, registered in transformers' ``AttentionInterface``;
* both: ``inputs.SequenceSharder``'s hooks cut each batch to this rank's chunks and give
  the loss its cp form.

Under a pipeline: ``parallelize`` installs the hooks before step 4 cuts the model, and
each stage runs a shallow copy of the root module (``pipeline.split._rewire``), which
shares the root's hooks: every stage cuts the batch it is given the same way (later
stages only use its positions and document ids, and the chunk-long dummy ids that carry
the activation's shape), and the last stage's loss gets its cp form. A transformers
model's stages before the last call its backbone (``Layout.body``) directly, so the
backbone gets the same pre-hook; called from the hooked root it finds the batch marked as
cut (``inputs.CUT``) and passes it on. Each cp rank of a stage sends to the same cp rank
of the next stage.

A mixture-of-experts model (the Decoder with ``model.moe``, Mixtral): the router's
auxiliary loss is over the replica's whole rows, its counts summed over the cp ranks
(``parallelize`` hands ``parallel.experts.aux_loss`` the cp group, or dp x cp with
``loss.global_aux_loss``); rows with padding are refused for it (``inputs.py``).

Refused by name: any other model, and chunked loss (``loss.chunked``: its head sees only
this rank's tokens and its count would be local).
"""

from __future__ import annotations

from torch import nn

from meshtrain.distributed.topology import Topology
from meshtrain.errors import ConfigError
from meshtrain.families.rooms import ROOMS, is_one_of, model_type, room_of
from meshtrain.parallel.context import transformers_attention as hf
from meshtrain.parallel.context.context import ContextParallel
from meshtrain.parallel.context.inputs import SequenceSharder
from meshtrain.parallel.experts.shard import expert_modules
from meshtrain.parallel.pipeline.split import find_layout

# the transformers model types whose attention the rooms say cp replaces, in room order
FAMILIES: tuple[str, ...] = tuple(t for room in ROOMS for t in room.context_types)


def check_context_parallel(model: nn.Module, topology: Topology, config) -> str:
    """The model's family ("decoder" or "transformers"), or ConfigError naming what does
    not compose with cp (before anything changes)."""
    cp = topology.cp_size
    if config.loss.chunked:
        raise ConfigError(
            f"loss.chunked with mesh.context_parallel_size {cp} is not built; set "
            "loss.chunked to false (each rank's logits are already 1/C of the sequence)"
        )
    room, kind = room_of(model), model_type(model)
    if room is not None and room.context_attention:  # meshtrain's own: the seam's context
        return "decoder"
    if room is not None and kind in room.context_types:
        return "transformers"
    raise ConfigError(
        f"mesh.context_parallel_size {cp}: {type(model).__name__} (model_type "
        f"{kind!r}) has no context-parallel attention; supported: meshtrain's Decoder "
        f"and transformers {', '.join(FAMILIES)}"
    )


def apply_context_parallel(model: nn.Module, topology: Topology, config) -> ContextParallel:
    """Wire ``model``'s attention and inputs to the cp group (module docstring)."""
    family = check_context_parallel(model, topology, config)
    context = ContextParallel(topology.cp_group, config.context_parallel.method)
    if family == "decoder":
        attention = room_of(model).context_attention
        for m in model.modules():
            if is_one_of(m, attention):
                m.context = context
    else:
        hf.register()
        layers = [m for m in model.modules() if _is_attention(m)]
        if not layers:
            raise ConfigError(f"{type(model).__name__}: no attention layer found for cp")
        for m in layers:
            setattr(m, hf.CONTEXT_ATTR, context)
        model.set_attn_implementation(hf.ATTN_NAME)
    routes = bool(expert_modules(model))
    sharder = SequenceSharder(model, topology.cp_group, family, routes)
    model.register_forward_pre_hook(sharder.pre, with_kwargs=True)
    model.register_forward_hook(sharder.post, with_kwargs=True)
    if family == "transformers" and topology.pp_size > 1:
        # a pipeline stage before the last calls the backbone itself: it cuts its batch
        # too (after the root's cut, the root's marker makes it pass the batch on as is)
        body = model.get_submodule(find_layout(model).body)
        body.register_forward_pre_hook(
            SequenceSharder(body, topology.cp_group, family, routes).pre, with_kwargs=True
        )
    return context


def _is_attention(m: nn.Module) -> bool:
    """A transformers self-attention layer: it reads config._attn_implementation."""
    name = type(m).__name__
    return name.endswith("Attention") and hasattr(m, "config") and hasattr(m, "layer_idx")


__all__ = ["FAMILIES", "apply_context_parallel", "check_context_parallel"]
