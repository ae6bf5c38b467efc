"""Tensor-parallel plans per layer kind, for models given as a list of layers.

A ``meshtrain.pipe.PipelineModule`` has no model class a family plan (``plans``) could be
picked by: it is a flat list of the user's layers (``layers.<i>``), each built from a
``LayerSpec``. Its plan is assembled from the layers themselves: every module inside a
layer whose class is a known transformer block gets that block's rows of its family's
plan, with the family's block prefix (``model.layers.*``, ``transformer.h.*``,
``layers.*``) replaced by the module's path. The rows are not written twice: they are
taken from the family plan the room's ``BlockPlan`` names (``rows_under``), so a block
shards in a PipelineModule exactly as it does inside its own model. The rooms
(``meshtrain.families``) declare today:

==========================================  ===============  ===========================
block class (``module.qualname``)             family plan      head counts read from
==========================================  ===============  ===========================
transformers ``LlamaDecoderLayer``,           ``LLAMA``'s      ``self_attn.config``
``Qwen2DecoderLayer``, ``MistralDecoderLayer``  rows
transformers ``GPT2Block``                    ``GPT2``         ``attn.config``
meshtrain ``models.decoder.Block``            ``DECODER``      ``attn.n_heads``
==========================================  ===============  ===========================

What the plan shards: ``1/T`` of every block's attention and MLP projections (as in the
family's model; bytes per block as ``apply``'s table without sequence parallelism: two
all-reduces of the block's activation forward, two backward). What it leaves
replicated: every other layer (embeddings, the final norm, the LM head, user layers),
whose inputs are full on every tp rank (a block's row layer all-reduces its output), so
their gradients are equal on every tp rank and counted once in the gradient norm. The
vocabulary is therefore not sharded (no vocab-parallel loss: ``loss_fn`` sees full
logits). Sequence parallelism is not offered: a PipelineModule's layers have no place
where the sequence is split and gathered (``sequence_parallel=False``, refused by name).
Tied layers (``TiedLayerSpec``) are never sharded (their gradient sum across stages holds
the full tensor).
"""

from __future__ import annotations

from torch import nn

from meshtrain.families.block_plan import BlockPlan
from meshtrain.families.rooms import ROOMS
from meshtrain.families.tp_plan import TPPlan

# every room's block plans, in room order
KINDS: tuple[BlockPlan, ...] = tuple(kind for room in ROOMS for kind in room.tp_blocks)


def kind_of(module: nn.Module) -> tuple[TPPlan, str, dict[str, str]] | None:
    """``(family plan, block prefix, sizes)`` of a known block class, else None."""
    name = f"{type(module).__module__}.{type(module).__qualname__}"
    for kind in KINDS:
        if name in kind.classes:
            return kind.plan, kind.prefix, kind.sizes
    return None


def rows_under(plan: TPPlan, prefix: str) -> tuple[tuple, ...]:
    """The rows of ``plan`` inside one block at ``prefix``, relative to the block; the
    rows naming the block itself (``model.layers.0``'s sequence scatter) are not
    inside it."""
    head = prefix + "."
    return tuple((r[0][len(head) :], *r[1:]) for r in plan.rows if r[0].startswith(head))


def attrs_under(plan: TPPlan, prefix: str) -> tuple[tuple[str, str, str], ...]:
    head = prefix + "."
    return tuple((p[len(head) :], a, u) for p, a, u in plan.attrs if p.startswith(head))


def layers_plan(layers: dict[str, nn.Module], name: str = "pipeline module") -> TPPlan:
    """The plan of a model made of ``layers`` (path -> built layer): each known block
    found inside a layer (outermost first; a block inside a block is the outer one's)
    gets its family's rows at its path, with unit sizes of its own (keys
    ``heads@<path>``), so blocks of different shapes or families may be mixed."""
    rows: list[tuple] = []
    attrs: list[tuple[str, str, str]] = []
    sizes: dict[str, str] = {}
    for top, layer in layers.items():
        blocks: list[str] = []
        for sub, module in layer.named_modules():
            path = f"{top}.{sub}" if sub else top
            if any(path.startswith(b + ".") for b in blocks):
                continue
            kind = kind_of(module)
            if kind is None:
                continue
            plan, prefix, units = kind
            blocks.append(path)
            key = {u: f"{u}@{path}" for u in units}
            sizes.update({key[u]: f"{path}.{p}" for u, p in units.items()})
            for r in rows_under(plan, prefix):
                unit = (key[r[2]],) if len(r) > 2 else ()
                rows.append((f"{path}.{r[0]}", r[1], *unit, *r[3:]))
            attrs.extend((f"{path}.{p}", a, key[u]) for p, a, u in attrs_under(plan, prefix))
    return TPPlan(
        name=name,
        rows=tuple(rows),
        sizes=sizes,
        attrs=tuple(attrs),
        sequence_parallel=False,
    )


__all__ = ["KINDS", "attrs_under", "kind_of", "layers_plan", "rows_under"]
