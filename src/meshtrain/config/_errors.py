"""Turn pydantic's ValidationError into ConfigError messages that name the path.

Every message has the shape ``<path>: <what is wrong>; <what to do>``, e.g.
``zero_optimization.stage: 4 is not allowed; use 0, 1, 2 or 3`` or
``zero_optimisation: unknown key; did you mean zero_optimization?``. Nothing here lets a raw
pydantic traceback reach the user: the allowed values are described from the field's own
annotation, so the messages stay true as fields change.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from meshtrain.errors import ConfigError

# Keys DeepSpeed users write that meshtrain spells differently (or not at all).
RENAMED = {
    "bfloat16": "use bf16 (DeepSpeed's current name)",
    "tensor_parallel": "set mesh.tensor_parallel_size instead",
    "cpu_offload": 'use offload_optimizer: {"device": "cpu"}',
    "cpu_offload_param": 'use offload_param: {"device": "cpu"}',
    "stage3_gather_fp16_weights_on_model_save": "use stage3_gather_16bit_weights_on_model_save",
}


def show(value: Any) -> str:
    """A value as the user wrote it (JSON spelling: true, null, "text")."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def did_you_mean(key: str, valid: typing.Iterable[str]) -> str:
    """The ``; did you mean X?`` hint for an unknown key (or the list of valid keys)."""
    valid = list(valid)
    if key in RENAMED:
        return f"; {RENAMED[key]}"
    lowered = {v.lower(): v for v in valid}
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {lowered[close[0]]}?"
    if len(valid) <= 16:
        return f"; valid keys: {', '.join(valid)}"
    return "; see docs/config.md for the valid keys"


def _join_or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def strip_annotated(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    while typing.get_origin(annotation) is typing.Annotated:
        args = typing.get_args(annotation)
        annotation, metadata = args[0], [*metadata, *args[1:]]
    return annotation, metadata


def union_members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in union_members(a)]
    return [annotation]


_NUMBER_WORDS = {int: "an integer", float: "a number", str: "a string"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def bounds_text(metadata: list[Any]) -> str:
    parts = []
    for m in metadata:
        for cls, attr, sym in (
            (Ge, "ge", ">="),
            (Gt, "gt", ">"),
            (Le, "le", "<="),
            (Lt, "lt", "<"),
        ):
            if isinstance(m, cls):
                parts.append(f"{sym} {getattr(m, attr)}")
    return (" " + " and ".join(parts)) if parts else ""


def describe_type(annotation: Any, metadata: list[Any] | None = None) -> list[str]:
    """Human descriptions of the alternatives an annotation allows (one per union member)."""
    out: list[str] = []
    for member in union_members(annotation):
        member, meta = strip_annotated(member, list(metadata or []))
        if typing.get_origin(member) in (Union, types.UnionType):
            out += describe_type(member, meta)
        elif typing.get_origin(member) is Literal:
            out += [show(v) for v in typing.get_args(member)]
        elif member is type(None):
            out.append("null")
        elif member is bool:
            out += ["true", "false"]
        elif member in _NUMBER_WORDS:
            out.append(_NUMBER_WORDS[member] + bounds_text(meta))
        elif isinstance(member, type) and issubclass(member, BaseModel):
            out.append("a mapping (JSON object)")
        elif typing.get_origin(member) is tuple:
            inner = typing.get_args(member)
            out.append(
                f"a list of {len(inner)} numbers" + bounds_text(strip_annotated(inner[0], [])[1])
            )
        elif typing.get_origin(member) is list:
            item = strip_annotated(typing.get_args(member)[0], [])[0]
            out.append("a list of " + _PLURALS.get(item, "values"))
        elif typing.get_origin(member) is dict or member is dict:
            out.append("a mapping (JSON object)")
        else:
            out.append(getattr(member, "__name__", str(member)))
    return list(dict.fromkeys(out))


def allowed(field: FieldInfo) -> str:
    """``use 0, 1, 2 or 3`` for pure choices, else ``expected an integer >= 0 or "auto"``."""
    alts = describe_type(field.annotation, list(field.metadata))
    only_literals = all(
        typing.get_origin(strip_annotated(m, [])[0]) is Literal or m is type(None)
        for m in union_members(field.annotation)
    )
    return ("use " if only_literals else "expected ") + _join_or(alts)


def models_in(annotation: Any) -> list[type[BaseModel]]:
    found = []
    for member in union_members(annotation):
        member, _ = strip_annotated(member, [])
        if isinstance(member, type) and issubclass(member, BaseModel):
            found.append(member)
    return found


def _walk(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], FieldInfo | None, list]:
    """Follow a pydantic ``loc`` through the models: (user's keys, field, enclosing models).

    List indices and union-member tags are dropped: a message is about the whole field.
    """
    models: list[type[BaseModel]] = [root]
    keys: list[str] = []
    field: FieldInfo | None = None
    parents: list[type[BaseModel]] = []
    for item in loc:
        if isinstance(item, int):
            continue
        owner = next((m for m in models if item in m.model_fields), None)
        if owner is not None:
            field, parents = owner.model_fields[item], [owner]
            models = models_in(field.annotation)
            keys.append(item)
        elif any(m.__name__ == item for m in models):  # union tag naming a model
            models = [m for m in models if m.__name__ == item]
        elif models:  # a key no model knows: the unknown key itself
            parents, field, models = models, None, []
            keys.append(item)
        # else: a union-member tag inside a leaf field; not part of the user's path
    return keys, field, parents


_NOT_FOUND = object()


def _lookup(raw: Any, keys: list[str]) -> Any:
    for key in keys:
        if not isinstance(raw, dict) or key not in raw:
            return _NOT_FOUND
        raw = raw[key]
    return raw


def error_messages(
    exc: ValidationError, root: type[BaseModel], prefix: str = "", raw: Any = None
) -> list[str]:
    """One message per offending path, in the order pydantic found them.

    ``raw`` is the data as the user wrote it, so a message shows ``-1``, not the coerced ``-1.0``.
    """
    messages: dict[str, str] = {}
    for err in exc.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):  # raised by our own validators: already phrased
            messages.setdefault(str(inner), str(inner))
            continue
        keys, field, parents = _walk(root, tuple(err["loc"]))
        path = ".".join([prefix, *keys] if prefix else keys) or "config"
        value = _lookup(raw, keys)
        value = show(err.get("input") if value is _NOT_FOUND else value)
        if path in messages:
            continue
        kind = err["type"]
        if kind in ("extra_forbidden", "no_such_attribute"):
            names = [n for p in parents for n in p.model_fields]
            key = path.rsplit(".", 1)[-1]
            messages[path] = f"{path}: unknown key{did_you_mean(key, dict.fromkeys(names))}"
        elif kind == "missing" and not isinstance(err["loc"][-1], int):
            hint = allowed(field) if field is not None else "add it"
            messages[path] = f"{path}: missing required key; {hint}"
        elif field is None:  # a whole section of the wrong type at the top
            messages[path] = f"{path}: {value} is not allowed; expected a mapping"
        else:
            messages[path] = f"{path}: {value} is not allowed; {allowed(field)}"
    return list(messages.values())


def translate(
    exc: ValidationError, root: type[BaseModel], prefix: str = "", raw: Any = None
) -> ConfigError:
    """A ConfigError listing every problem in ``exc`` (first line: the first problem)."""
    return ConfigError("\n".join(error_messages(exc, root, prefix, raw)))
