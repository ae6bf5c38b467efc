"""The room of transformers' GPT-NeoX (``model_type`` ``gpt_neox``, Pythia): known to
packing only (its packed rows are proven document-exact, tests/data/test_packing.py); no
parallel plan."""

from __future__ import annotations

from meshtrain.families.room import Room

ROOM = Room(name="gpt_neox", model_types=("gpt_neox",), packing_types=("gpt_neox",))

__all__ = ["ROOM"]
