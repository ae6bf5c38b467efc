"""Input readers for ``prepare``: JSONL, CSV/TSV, plain text, JSON arrays, ``datasets.Dataset``.

A reader turns an input into rows ``(line, text, label)``; every other row is either
*empty* (``None`` or blank text: skipped and counted, never an error) or *bad*
(malformed JSON/CSV, an object without the text field -- usually a wrong ``--text-field``
--, a text that is not a string, a label that is not an integer). A bad
row carries its file and line so ``prepare`` can raise :class:`~meshtrain.errors.DataError`
naming them, or skip and count it under ``--skip-bad-rows``.

Encodings: UTF-8 (with or without a BOM) is read as it is; UTF-16 and UTF-32 with a BOM
(what Windows editors save as "Unicode") are decoded with the BOM and re-encoded to UTF-8
as they are read (``files.text.utf8_stream``), then handled like any UTF-8 file: such a
file is parsed in the main process (its byte ranges are not UTF-8). Line numbers are the
same in both encodings. Invalid bytes, binary files and UTF-16 without a BOM are named.

Uncompressed UTF-8 JSONL and text files are cut into byte ranges on line boundaries and parsed
in the worker processes (parsing is as costly as tokenizing for short rows). Line numbers
inside a range are relative; ``prepare`` adds the lines of the earlier ranges. CSV (quoted
fields may span lines), gzip files, JSON arrays and datasets are parsed in the main process
and only their texts go to the workers.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from meshtrain.errors import DataError
from meshtrain.files.structured import json_row, parse_json
from meshtrain.files.text import bom_encoding, decode, utf8_stream

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv", ".tsv")


@dataclass
class Rows:
    """Parsed rows of one chunk: kept texts, their labels, and what was skipped."""

    texts: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    lines: int = 0  # physical lines (or records) read
    empty: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)


def detect_format(path: str) -> str:
    """``jsonl``, ``json_array``, ``csv``, ``tsv`` or ``text`` from the name (``.gz`` allowed)."""
    name = path[:-3] if path.endswith(".gz") else path
    _check_encoding(path)
    lower = name.lower()
    if lower.endswith(".tsv"):
        return "tsv"
    if lower.endswith(".csv"):
        return "csv"
    if lower.endswith(JSONL_SUFFIXES):
        if lower.endswith(".json") and _first_byte(path) == b"[":
            return "json_array"
        return "jsonl"
    return "text"


def _open_raw(path: str) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # type: ignore[return-value]


def _open_binary(path: str) -> io.BufferedIOBase:
    """The file (gunzipped) as UTF-8 bytes, whatever accepted encoding it is in."""
    return utf8_stream(_open_raw(path), path, DataError, what="data file")  # type: ignore[return-value]


def encoding(path: str) -> str:
    """``utf-8``, or the UTF-16/32 encoding its byte-order mark names."""
    with _open_raw(path) as f:
        return bom_encoding(f.read(4))[0]


def _check_encoding(path: str) -> None:
    """Name a binary input or UTF-16 without a BOM up front (rows are read as UTF-8, where
    such a file would only show up as every row being malformed)."""
    try:
        with _open_binary(path) as f:
            head = f.read(4096)
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read the data file ({exc}); check the path") from None
    if b"\x00" in head:  # UTF-16 without a BOM, or a binary file: named with the position
        decode(head, path, DataError, what="data file")


def _first_byte(path: str) -> bytes:
    with _open_binary(path) as f:
        while True:
            b = f.read(1)
            if not b or not b.isspace():
                return b


def is_splittable(path: str, fmt: str) -> bool:
    """Whether workers can parse byte ranges of this file themselves."""
    return fmt in ("jsonl", "text") and not path.endswith(".gz") and encoding(path) == "utf-8"


def split_ranges(path: str, chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``chunk_bytes`` that start and end on line boundaries."""
    size = os.path.getsize(path)
    ranges = []
    start = 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(size, start + chunk_bytes))
            f.readline()
            end = min(size, f.tell())
            ranges.append((start, end))
            start = end
    return ranges


def _check_label(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    raise ValueError(f"label {value!r} is not an integer")


def _add(rows: Rows, line: int, text: Any, label: Any, label_field: str | None, where: str) -> None:
    if text is None or (isinstance(text, str) and not text.strip()):
        rows.empty += 1
        return
    if not isinstance(text, str):
        rows.bad.append((line, f"{where} is {type(text).__name__} {text!r:.40}, expected a string"))
        return
    if label_field is not None:
        try:
            label = _check_label(label)
        except ValueError as exc:
            rows.bad.append((line, f"field {label_field!r}: {exc}"))
            return
        rows.labels.append(label)
    rows.texts.append(text)


def _missing(text_field: str, obj: dict) -> str:
    fields = ", ".join(map(repr, list(obj)[:8])) or "none"
    return (
        f"no field {text_field!r} in this row (its fields: {fields}); pass --text-field with "
        "the right name, or --skip-bad-rows to skip such rows"
    )


def parse_lines(
    data: bytes,
    fmt: str,
    text_field: str,
    label_field: str | None,
    stop_at_bad: bool,
) -> Rows:
    """Parse a byte range of a JSONL or text file; line numbers in ``bad`` are 1-based and
    relative to the range."""
    rows = Rows()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    rows.lines = len(lines)
    for i, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
            if i == 1 and line.startswith("\ufeff"):  # a UTF-8 BOM opens the file
                line = line[1:]
        except UnicodeDecodeError as exc:
            rows.bad.append((i, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"))
            if stop_at_bad:
                return rows
            continue
        if fmt == "text":
            _add(rows, i, line.rstrip("\r"), None, None, "line")
            continue
        if not line.strip():
            rows.empty += 1
            continue
        obj, reason = json_row(line)  # duplicate keys are bad rows too, with both columns
        if reason is not None:
            rows.bad.append((i, reason))
        else:
            if not isinstance(obj, dict):
                rows.bad.append((i, f"expected a JSON object, got {type(obj).__name__}"))
            elif text_field not in obj:
                rows.bad.append((i, _missing(text_field, obj)))
            else:
                label = obj.get(label_field) if label_field else None
                _add(rows, i, obj.get(text_field), label, label_field, f"field {text_field!r}")
        if stop_at_bad and rows.bad:
            return rows
    return rows


def iter_main_rows(
    path: str, fmt: str, text_field: str, label_field: str | None, batch_rows: int
) -> Iterator[Rows]:
    """Rows of a file that is parsed in the main process, ``batch_rows`` records at a time;
    line numbers in ``bad`` are absolute."""
    if fmt in ("csv", "tsv"):
        yield from _iter_csv(
            path, "\t" if fmt == "tsv" else ",", text_field, label_field, batch_rows
        )
    elif fmt == "json_array":
        yield from _iter_json_array(path, text_field, label_field, batch_rows)
    else:  # gzip-compressed jsonl / text: stream the lines
        with _open_binary(path) as f:
            offset = 0
            while True:
                block = f.readlines(1 << 22)
                if not block:
                    return
                rows = parse_lines(b"".join(block), fmt, text_field, label_field, False)
                rows.bad = [(line + offset, msg) for line, msg in rows.bad]
                offset += len(block)
                yield rows


def _iter_csv(
    path: str, delimiter: str, text_field: str, label_field: str | None, batch_rows: int
) -> Iterator[Rows]:
    with _open_binary(path) as fb:
        f = io.TextIOWrapper(fb, encoding="utf-8-sig", newline="")  # a BOM is dropped
        reader = csv.reader(f, delimiter=delimiter, strict=True)
        try:
            header = next(reader)
        except StopIteration:
            return
        except (csv.Error, UnicodeDecodeError) as exc:
            raise DataError(f"{path}:1: cannot read the CSV header ({exc})") from exc
        for col, name in enumerate(header):
            if name in header[:col]:
                raise DataError(
                    f"{path}:1: column {name!r} appears twice in the header (columns "
                    f"{header.index(name) + 1} and {col + 1}); rename one of them"
                )
        if text_field not in header:
            raise DataError(
                f"{path}:1: no column {text_field!r} in the header (columns: {header}); "
                "pass --text-field with one of them"
            )
        if label_field is not None and label_field not in header:
            raise DataError(
                f"{path}:1: no column {label_field!r} (columns: {header}); fix --label-field"
            )
        ti = header.index(text_field)
        li = header.index(label_field) if label_field is not None else None
        rows = Rows()
        while True:
            try:
                record = next(reader)
            except StopIteration:
                break
            except (csv.Error, UnicodeDecodeError) as exc:
                rows.lines += 1
                rows.bad.append((reader.line_num, f"malformed CSV ({exc})"))
                if isinstance(exc, UnicodeDecodeError):
                    break  # the decoder cannot continue past invalid bytes
                continue
            rows.lines += 1
            if not record:
                rows.empty += 1
            elif len(record) != len(header):
                rows.bad.append(
                    (
                        reader.line_num,
                        f"malformed CSV (expected {len(header)} fields, got {len(record)})",
                    )
                )
            else:
                label = record[li] if li is not None else None
                _add(
                    rows, reader.line_num, record[ti], label, label_field, f"column {text_field!r}"
                )
            if rows.lines >= batch_rows:
                yield rows
                rows = Rows()
        yield rows


def _iter_json_array(
    path: str, text_field: str, label_field: str | None, batch_rows: int
) -> Iterator[Rows]:
    with _open_binary(path) as f:
        raw = f.read()
    items = parse_json(
        decode(raw, path, DataError, what="data file"),
        path,
        DataError,
        fix="fix the file or convert it to JSONL",
    )
    if not isinstance(items, list):
        raise DataError(
            f"{path}:1: expected a JSON array of objects or JSONL, got {type(items).__name__}"
        )
    for lo in range(0, len(items), batch_rows):
        rows = Rows()
        for i, obj in enumerate(items[lo : lo + batch_rows], start=lo + 1):
            rows.lines += 1
            if not isinstance(obj, dict):
                rows.bad.append((i, f"item {i} is {type(obj).__name__}, expected an object"))
                continue
            if text_field not in obj:
                rows.bad.append((i, _missing(text_field, obj)))
                continue
            label = obj.get(label_field) if label_field else None
            _add(rows, i, obj.get(text_field), label, label_field, f"field {text_field!r}")
        yield rows


def iter_dataset_rows(
    ds: Any, text_field: str, label_field: str | None, batch_rows: int
) -> Iterator[Rows]:
    """Rows of a ``datasets.Dataset`` (or a dict of columns); ``line`` is the 0-based row."""
    columns = list(getattr(ds, "column_names", None) or ds.keys())
    for name in (text_field, label_field):
        if name is not None and name not in columns:
            raise DataError(
                f"dataset has no column {name!r} (columns: {columns}); fix --text-field/--label-field"
            )
    n = len(ds) if hasattr(ds, "column_names") else len(ds[text_field])
    for lo in range(0, n, batch_rows):
        batch = (
            ds[lo : lo + batch_rows]
            if hasattr(ds, "column_names")
            else {
                k: ds[k][lo : lo + batch_rows] for k in (text_field, label_field) if k is not None
            }
        )
        rows = Rows()
        texts = batch[text_field]
        labels = batch[label_field] if label_field is not None else [None] * len(texts)
        for i, (text, label) in enumerate(zip(texts, labels, strict=True), start=lo):
            rows.lines += 1
            _add(rows, i, text, label, label_field, f"column {text_field!r}")
        yield rows
