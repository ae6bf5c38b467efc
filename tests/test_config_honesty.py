"""Every config key either acts or says it does not.

A key documented as "Accepted and ignored" warns once, naming itself, when set to
anything but its default; every other key is exercised by some test (its name and its
section's name appear together in a test file).
"""

from __future__ import annotations

import logging
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from meshtrain.config import Config, load_config
from meshtrain.config.ignored import MARK, ignored_settings, warn_ignored
from meshtrain.config.optimizer import OPTIMIZER_PARAMS, SCHEDULER_PARAMS

TESTS = Path(__file__).parent


def _leaves(model: type[BaseModel], path: str = ""):
    """(dotted path, field) of every leaf field, descending into section models; the
    per-type ``params`` of optimizer and scheduler are walked by ``_typed_leaves``."""
    for name, field in model.model_fields.items():
        where = f"{path}.{name}" if path else name
        if where in ("optimizer.params", "scheduler.params"):
            continue
        args = typing.get_args(field.annotation) or (field.annotation,)
        sections = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections:
            yield from _leaves(sections[0], where)
        else:
            yield where, field


def _other_value(field):
    """A valid value different from the field's default."""
    default = field.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7
    if isinstance(default, float):
        return default * 2 + 1
    if default is None:
        # Optional[...] members, with Annotated[...] unwrapped to its base type
        kinds = [
            typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
            for a in typing.get_args(field.annotation)
        ]
        kinds = [typing.get_origin(a) or a for a in kinds]
        if dict in kinds:
            return {"enabled": True}
        if bool in kinds:
            return True
        return "llama" if str in kinds else 3
    if isinstance(default, str):
        for choice in ("O2", "abc"):
            if choice != default:
                return choice
    raise AssertionError(f"no other value for {field}")


def _typed_leaves():
    """(path, field, the section's type) for every optimizer/scheduler params field."""
    for section, table in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        for kind, model in table.items():
            for where, field in _leaves(model, f"{section}.params"):
                yield where, field, kind


def _nested(path: str, value, kind: str | None = None) -> dict:
    out: dict = {}
    if kind is not None:
        out[path.split(".")[0]] = {"type": kind}
    node = out
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    if path.startswith("zero_optimization.offload"):
        out["zero_optimization"]["stage"] = 3
    return out


SECTION_TYPE = {"optimizer": "AdamW", "scheduler": "WarmupLR"}  # sections needing a type
ALL = [(p, f, SECTION_TYPE.get(p.split(".")[0])) for p, f in _leaves(Config)]
ALL += list(_typed_leaves())
IGNORED = [(p, f, k) for p, f, k in ALL if (f.description or "").startswith(MARK)]
ACTING = sorted({p for p, f, _ in ALL if not (f.description or "").startswith(MARK)})


@pytest.mark.parametrize(
    ("path", "field", "kind"), IGNORED, ids=[f"{p}[{k}]" if k else p for p, _, k in IGNORED]
)
def test_ignored_key_warns_once_naming_itself(path, field, kind, caplog) -> None:
    config = load_config(_nested(path, _other_value(field), kind))
    logger = logging.getLogger("meshtrain.test")
    with caplog.at_level(logging.WARNING, logger="meshtrain.test"):
        assert warn_ignored(config, logger) == [path]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and path in messages[0] and MARK in messages[0]


def test_defaults_and_switched_off_sections_warn_nothing() -> None:
    assert ignored_settings(load_config({})) == []
    quiet = {"flops_profiler": {"enabled": False}, "zero_optimization": {"sub_group_size": 1e9}}
    assert ignored_settings(load_config(quiet)) == []


def test_the_listed_keys_are_decided() -> None:
    """The keys the architecture issue named: each acts (tested) or is marked ignored."""
    marked = {p for p, _, _ in IGNORED}
    for key in ("reduce_scatter", "contiguous_gradients", "allgather_partitions"):
        assert f"zero_optimization.{key}" in marked
    for key in ("allgather_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        assert f"zero_optimization.{key}" in marked
    for key in (
        "zero_optimization.overlap_comm",
        "zero_optimization.ignore_unused_parameters",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "wall_clock_breakdown",
    ):
        assert key in ACTING


def test_every_acting_key_is_exercised_by_a_test() -> None:
    sources = {
        p: p.read_text(encoding="utf-8", errors="replace")
        for p in TESTS.rglob("*")
        if p.suffix in (".py", ".json", ".yaml", ".yml") and p.name != Path(__file__).name
    }
    missing = []
    for path in ACTING:
        parts = path.split(".")
        leaf, section = parts[-1], parts[-2] if len(parts) > 1 else None
        if not any(
            leaf in text and (section is None or section in text) for text in sources.values()
        ):
            missing.append(path)
    assert missing == [], f"config keys no test exercises: {missing}"
