"""``Room``: everything meshtrain knows of one model family, in one frozen record.

Each family's file in ``meshtrain.families`` declares one (``ROOM``); the parallel
mechanisms and the estimator read the rooms (``families.rooms.ROOMS``) instead of keeping
per-family tables of their own. A field left at its default means meshtrain knows
nothing of that kind for the family: the mechanism refuses it by name, as it refuses a
model no room names.

==================  ==============================================  ==========================
field               what it declares                                read by
==================  ==============================================  ==========================
model_types         transformers ``config.model_type`` values       ``families.rooms.room_of``
classes             meshtrain's own model classes                   ``families.rooms.room_of``
                    (``module.qualname``, matched along the MRO)
tp_plans            tensor-parallel plans, each naming the model    ``parallel.tensor.plans``
                    classes it is the default for
tp_blocks           the rows of one block in a PipelineModule        ``parallel.tensor.
                                                                    layer_plans``
layout              where the blocks, first- and last-stage         ``parallel.pipeline.split``
                    modules are, for a pipeline
context_types       model types whose attention context             ``parallel.context.apply``
                    parallelism replaces (transformers' registry)
context_attention   meshtrain attention classes whose               ``parallel.context.apply``
                    ``context`` the seam reads
expert_classes      experts module classes expert parallelism       ``parallel.experts.shard``
                    shards (and tp, pp leave whole / cut)
packing_types       model types whose packed rows are proven        ``models.packed_batches``
                    document-exact (tests/data/test_packing.py)
activation_types    model types the activation-memory formula       ``estimate.activations``
                    counts (dense, Llama-shaped)
config_names        where the config keeps those sizes              ``estimate.activations``
==================  ==============================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.families.block_plan import BlockPlan
from meshtrain.families.config_names import ConfigNames
from meshtrain.families.layout import Layout
from meshtrain.families.tp_plan import TPPlan


@dataclass(frozen=True)
class Room:
    """What meshtrain knows of one model family (fields: the module docstring's table)."""

    name: str
    model_types: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    tp_plans: tuple[TPPlan, ...] = ()
    tp_blocks: tuple[BlockPlan, ...] = ()
    layout: Layout | None = None
    context_types: tuple[str, ...] = ()
    context_attention: tuple[str, ...] = ()
    expert_classes: tuple[str, ...] = ()
    packing_types: tuple[str, ...] = ()
    activation_types: tuple[str, ...] = ()
    config_names: ConfigNames | None = None


__all__ = ["Room"]
