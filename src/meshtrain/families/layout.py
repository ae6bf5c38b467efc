"""``Layout``: where a model family keeps its blocks, its first-stage and its last-stage
modules, for cutting the model into pipeline stages (``parallel.pipeline.split``).

Each model family's room (``meshtrain.families.<family>``) declares its layout;
``split.find_layout`` tries the rooms' layouts in order and takes the first whose block
list and input embedding the model has. The record lives here, below ``parallel/``, so a
room can declare one without importing the mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """Where a model family keeps its blocks, its first-stage and its last-stage modules.

    ``first`` maps a module path to its role on later stages: ``"input"`` (returns the
    received activation), ``"zero"`` (adds nothing, e.g. learned positions) or
    ``"identity"`` (e.g. an embedding dropout already applied on stage 0). ``body`` is
    the backbone that stages before the last call instead of the whole model (its first
    output is the hidden states): a task head may do more than its modules, e.g. a
    sequence classifier pools the last non-padding token after ``score``.
    ``sequence_shards``: whether a stage before the last may return a sequence shard under
    sequence parallelism (False refuses the layout under SP with a pipeline).
    ``reshapes_after``: the module after which the model's forward reshapes its output to
    the full length (GPT2Model's ``view(-1, t, d)`` after ``ln_f``, which would fold a
    ``[b, t/T, d]`` shard into ``b/T`` rows, or fail, on a stage whose final norm is the
    identity). Under sequence parallelism a stage before the last replaces it with a
    stand-in that keeps the shard and hands the reshape a full-length zero-stride
    placeholder (no storage); the stage then returns the kept shard, so what crosses the
    boundary is still ``b x t/T x d``.
    """

    blocks: str
    first: dict[str, str] = field(default_factory=dict)
    last: tuple[str, ...] = ()
    body: str | None = None
    sequence_shards: bool = True
    reshapes_after: str | None = None


__all__ = ["Layout"]
