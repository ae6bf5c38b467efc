"""``apply_context_parallel(model, topology, config)``: step 2 of ``parallelize``.

What it changes (no parameter: a checkpoint is the same at any C):

* meshtrain's ``Decoder``: each ``Attention.context`` is set to one ``ContextParallel``
  (the seam in ``models/attention.py`` calls ``context.attend``);
* transformers Llama, Qwen2, Mistral, GPT-2 and Mixtral (``FAMILIES``): each attention layer gets
  the context as ``meshtrain_context`` and the model's attention implementation becomes
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
from meshtrain.parallel.context.context import ContextParallel
from meshtrain.parallel.context.inputs import SequenceSharder

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "mixtral")


def check_context_parallel(model: nn.Module, topology: Topology, config) -> str:
    """The model's family ("decoder" or "transformers"), or ConfigError naming what does
    not compose with cp (before anything changes)."""
    cp = topology.cp_size
    if config.loss.chunked:
        raise ConfigError(
            f"loss.chunked with mesh.context_parallel_size {cp} is not built; set "
            "loss.chunked to false (each rank's logits are already 1/C of the sequence)"
        )
    from meshtrain.models.decoder import Decoder

    if isinstance(model, Decoder):
        return "decoder"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in FAMILIES:
        return "transformers"
    raise ConfigError(
        f"mesh.context_parallel_size {cp}: {type(model).__name__} (model_type "
        f"{model_type!r}) has no context-parallel attention; supported: meshtrain's Decoder "
        f"and transformers {', '.join(FAMILIES)}"
    )


def apply_context_parallel(model: nn.Module, topology: Topology, config) -> ContextParallel:
    """Wire ``model``'s attention and inputs to the cp group (module docstring)."""
    family = check_context_parallel(model, topology, config)
    context = ContextParallel(topology.cp_group, config.context_parallel.method)
    if family == "decoder":
        from meshtrain.models.decoder import Attention

        for m in model.modules():
            if isinstance(m, Attention):
                m.context = context
    else:
        from meshtrain.parallel.context import transformers_attention as hf

        hf.register()
        layers = [m for m in model.modules() if _is_attention(m)]
        if not layers:
            raise ConfigError(f"{type(model).__name__}: no attention layer found for cp")
        for m in layers:
            setattr(m, hf.CONTEXT_ATTR, context)
        model.set_attn_implementation(hf.ATTN_NAME)
    from meshtrain.parallel.experts.shard import expert_modules

    routes = bool(expert_modules(model))
    sharder = SequenceSharder(model, topology.cp_group, family, routes)
    model.register_forward_pre_hook(sharder.pre, with_kwargs=True)
    model.register_forward_hook(sharder.post, with_kwargs=True)
    if family == "transformers" and topology.pp_size > 1:
        # a pipeline stage before the last calls the backbone itself: it cuts its batch
        # too (after the root's cut, the root's marker makes it pass the batch on as is)
        from meshtrain.parallel.pipeline.split import find_layout

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
