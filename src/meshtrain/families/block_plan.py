"""``BlockPlan``: how one family's transformer block shards when it stands alone, as a
layer of a ``meshtrain.pipe.PipelineModule`` (``parallel.tensor.layer_plans``).

A PipelineModule has no model class a family plan could be picked by; its plan is
assembled from the blocks found inside its layers. A block plan names the block classes,
the family plan whose rows under ``prefix`` are the block's (so the rows are written once,
in the family plan), and where a block reads its own head counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtrain.families.tp_plan import TPPlan


@dataclass(frozen=True)
class BlockPlan:
    """``classes``: the block classes (``module.qualname``); ``plan``: the family plan whose
    rows under ``prefix`` (``model.layers.*``) are one block's; ``sizes``: unit sizes as
    attribute paths inside one block (``{"heads": "attn.n_heads"}``)."""

    classes: tuple[str, ...]
    plan: TPPlan
    prefix: str
    sizes: dict[str, str] = field(default_factory=dict)


__all__ = ["BlockPlan"]
