"""Sharded checkpoints: every rank writes its own shard, atomically committed, read back
at any layout, exported as one streamed safetensors file.

Storage layer (this package): ``save_shards`` writes, ``CheckpointReader`` reads and
verifies, ``consolidate`` exports; ``Piece`` describes where elements live. The engine
decides which elements each rank owns (``docs/checkpoints.md``).
"""

from __future__ import annotations

from meshtrain.checkpoint.consolidate import consolidate
from meshtrain.checkpoint.manifest import FORMAT_VERSION, Piece, dtype_from_name, dtype_name
from meshtrain.checkpoint.reader import CheckpointReader
from meshtrain.checkpoint.storage import latest_tag, list_tags
from meshtrain.checkpoint.writer import PHASES, save_shards

__all__ = [
    "FORMAT_VERSION",
    "PHASES",
    "CheckpointReader",
    "Piece",
    "consolidate",
    "dtype_from_name",
    "dtype_name",
    "latest_tag",
    "list_tags",
    "save_shards",
]
