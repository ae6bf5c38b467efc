"""The room of transformers' OLMo (``model_type`` ``olmo``): known to packing only (its
packed rows are proven document-exact, tests/data/test_packing.py); no parallel plan."""

from __future__ import annotations

from meshtrain.families.room import Room

ROOM = Room(name="olmo", model_types=("olmo",), packing_types=("olmo",))

__all__ = ["ROOM"]
