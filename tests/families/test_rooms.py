"""The family rooms (``meshtrain.families``): nothing the per-family tables knew is lost,
and each room is one constant record.

* Every lookup the TP plan table, the TP block table, the pipeline layouts, context
  parallelism, expert sharding, packing and the activation estimate answered before the
  rooms (``tables_before_rooms.json``, written by ``family_tables.tables()`` on main at
  782d58d) is answered the same now, model class by model class: the same plan (name,
  rows, sizes, attrs, loss), the same layouts in the same order, the same families
  accepted and refused. Exact equality: these are tables, there is no tolerance.
* The rooms are a constant tuple of frozen records, each from one file of the package.
* Nothing below ``parallel/`` (``families``, ``components``) imports ``parallel`` or
  ``models``, and ``parallel`` imports no module of ``meshtrain.models``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from meshtrain.families.room import Room
from meshtrain.families.rooms import ROOMS, room_of
from tests.families.family_tables import tables
from tests.test_architecture import package_graph

HERE = Path(__file__).resolve().parent


def test_every_lookup_answers_as_before_the_rooms() -> None:
    before = json.loads((HERE / "tables_before_rooms.json").read_text(encoding="utf-8"))
    after = json.loads(json.dumps(tables()))  # tuples as lists, as in the file
    for table in before:  # one table at a time, so a failure names the table
        assert after[table] == before[table], table
    assert after.keys() == before.keys()


def test_each_room_is_one_frozen_record_of_its_own_file() -> None:
    """Every file of the package but the records and the collection holds one ``ROOM``,
    and ``ROOMS`` holds exactly those, each once, as a tuple of frozen ``Room``."""
    import importlib

    import meshtrain.families as package

    records = {"__init__", "rooms", "room", "tp_plan", "layout", "block_plan", "config_names"}
    homes = {}
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        if path.stem not in records:
            module = importlib.import_module(f"meshtrain.families.{path.stem}")
            homes[path.stem] = getattr(module, "ROOM", None)
    assert None not in homes.values(), f"family files without a ROOM: {homes}"
    assert isinstance(ROOMS, tuple) and sorted(map(id, ROOMS)) == sorted(map(id, homes.values()))
    assert all(type(r) is Room for r in ROOMS) and len({r.name for r in ROOMS}) == len(ROOMS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ROOMS[0].name = "changed"  # type: ignore[misc]


def test_room_of_names_the_family_of_a_model() -> None:
    from types import SimpleNamespace

    from meshtrain.models import Decoder, DecoderConfig

    class MyDecoder(Decoder):  # a subclass is its parent's family, as isinstance says
        pass

    cfg = DecoderConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=32)
    assert room_of(MyDecoder(cfg)).name == "meshtrain decoder"
    qwen3 = SimpleNamespace(config=SimpleNamespace(model_type="qwen3"))
    assert room_of(qwen3).name == "qwen"
    assert room_of(SimpleNamespace(config=SimpleNamespace(model_type="opt"))) is None
    assert room_of(object()) is None


def test_below_parallel_imports_nothing_above_it() -> None:
    """The package graph (function-local imports counted): ``families`` and ``components``
    import neither ``parallel`` nor ``models``, and ``parallel`` never imports ``models``."""
    graph = package_graph()
    above = {"meshtrain.parallel", "meshtrain.models"}
    for below in ("meshtrain.families", "meshtrain.components"):
        assert graph[below] & above == set(), f"{below} sits below parallel/ and models/"
    assert "meshtrain.models" not in graph["meshtrain.parallel"]
