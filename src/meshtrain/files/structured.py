"""JSON, YAML and JSON lines, one way for every input: duplicate keys refused, truncated
documents named, every error as ``file:line:col: problem; fix`` on one line.

Duplicate keys: JSON and YAML both let the last value win silently (``{"lr": 1e-3, ...,
"lr": 1}`` trains with ``lr=1``); DeepSpeed refuses them, and so do we, naming the key and
the line and column of both. JSON is parsed by the C decoder with a pairs hook that only
counts keys; the positions are found by a second, slower walk only once a duplicate is
known. YAML uses PyYAML's node marks.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml

from meshtrain.errors import MeshtrainError
from meshtrain.files.text import decode, line_col, read_bytes

_WS = re.compile(r"[ \t\n\r]*")


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


def _first_duplicate(text: str) -> tuple[str, int, int]:
    """``(key, first offset, second offset)`` of the first duplicated key in valid JSON."""
    raw_decode = json.JSONDecoder().raw_decode
    scanstring = json.decoder.scanstring  # type: ignore[attr-defined]

    def value(i: int) -> int:
        i = _WS.match(text, i).end()
        c = text[i]
        if c == "{":
            seen: dict[str, int] = {}
            i = _WS.match(text, i + 1).end()
            if text[i] == "}":
                return i + 1
            while True:
                i = _WS.match(text, i).end()
                key, end = scanstring(text, i + 1)
                if key in seen:
                    raise _Found(key, seen[key], i)
                seen[key] = i
                i = value(_WS.match(text, end).end() + 1)  # past the ':'
                i = _WS.match(text, i).end()
                if text[i] == "}":
                    return i + 1
                i += 1  # the ','
        if c == "[":
            i = _WS.match(text, i + 1).end()
            if text[i] == "]":
                return i + 1
            while True:
                i = _WS.match(text, value(i)).end()
                if text[i] == "]":
                    return i + 1
                i += 1
        return raw_decode(text, i)[1]

    try:
        value(0)
    except _Found as found:
        return found.key, found.first, found.second
    raise AssertionError("no duplicate key found")  # pragma: no cover - callers know one exists


class _Found(Exception):
    def __init__(self, key: str, first: int, second: int) -> None:
        self.key, self.first, self.second = key, first, second


def _dup_message(where: str, text: str, key: str, first: int, second: int, fix: str) -> str:
    l1, c1 = line_col(text, first)
    l2, c2 = line_col(text, second)
    return (
        f"{where}: duplicate key {key!r} at line {l2}, column {c2} (first at line {l1}, "
        f"column {c1}); JSON would keep only the last value silently: {fix}"
    )


def parse_json(
    text: str,
    where: str,
    error: type[MeshtrainError],
    *,
    fix: str = "fix the file",
    dup_fix: str = "keep one of them",
) -> Any:
    """Parse JSON ``text``; ``error`` names ``where``, line, column and the fix."""
    try:
        return json.loads(text, object_pairs_hook=_pairs)
    except _Duplicate:
        key, first, second = _first_duplicate(text)
        raise error(_dup_message(where, text, key, first, second, dup_fix)) from None
    except json.JSONDecodeError as exc:
        rest = text[exc.pos :].rstrip()
        if not rest or (exc.msg.startswith("Unterminated string") and "\n" not in rest):
            problem = "the JSON ends early (the file is truncated or incomplete)"
        else:
            problem = "invalid JSON"
        raise error(
            f"{where}: {problem} at line {exc.lineno}, column {exc.colno}: {exc.msg}; {fix}"
        ) from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read; {fix}") from None


def load_json(
    path: str | os.PathLike,
    error: type[MeshtrainError],
    *,
    what: str = "JSON file",
    fix: str = "fix the file",
    empty_fix: str = "write its content, or check the path",
) -> Any:
    """Read, decode and parse a JSON file (see :func:`parse_json`)."""
    where = os.fspath(path)
    text = decode(read_bytes(path, error, what), where, error, what=what, empty_fix=empty_fix)
    if not text.strip():
        raise error(f"{where}: the {what} holds only whitespace; {empty_fix}")
    return parse_json(text, where, error, fix=fix)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; SafeLoader raises its own error for it
                continue
            if first is not None:
                m1, m2 = first.start_mark, key_node.start_mark
                raise _YamlDuplicate(key, m1.line + 1, m1.column + 1, m2.line + 1, m2.column + 1)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


class _YamlDuplicate(Exception):
    def __init__(self, key: Any, l1: int, c1: int, l2: int, c2: int) -> None:
        self.key, self.l1, self.c1, self.l2, self.c2 = key, l1, c1, l2, c2


def parse_yaml(
    text: str, where: str, error: type[MeshtrainError], *, fix: str = "fix the file"
) -> Any:
    """Parse YAML ``text`` (safe types only); duplicate keys refused with both lines."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except _YamlDuplicate as d:
        raise error(
            f"{where}: duplicate key {d.key!r} at line {d.l2}, column {d.c2} (first at line "
            f"{d.l1}, column {d.c1}); YAML would keep only the last value silently: keep one "
            "of them"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        ctx = getattr(exc, "context", None)
        ends = mark is not None and mark.index >= len(text.rstrip())
        kind = "the YAML ends early" if ends else "invalid YAML"
        raise error(f"{where}: {kind}{pos}: {problem}{f' ({ctx})' if ctx else ''}; {fix}") from None
    except RecursionError:
        raise error(f"{where}: YAML nested too deeply to read; {fix}") from None


def json_row(line: str) -> tuple[Any, str | None]:
    """One JSON-lines record: ``(object, None)``, or ``(None, reason)`` for a bad row
    (malformed JSON, or a key given twice, with the columns of both)."""
    try:
        return json.loads(line, object_pairs_hook=_pairs), None
    except _Duplicate:
        key, first, second = _first_duplicate(line)
        return None, (
            f"duplicate key {key!r} at column {second + 1} (first at column {first + 1}); "
            "keep one of them"
        )
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return None, "malformed JSON (nested too deeply)"
