"""The room of transformers' Gemma (``model_type`` ``gemma``): known to packing only (its
packed rows are proven document-exact, tests/data/test_packing.py); no parallel plan."""

from __future__ import annotations

from meshtrain.families.room import Room

ROOM = Room(name="gemma", model_types=("gemma",), packing_types=("gemma",))

__all__ = ["ROOM"]
