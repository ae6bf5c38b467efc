"""Tokenizer files, read through the one reading path before a library parses them.

``transformers`` and ``tokenizers`` parse a tokenizer's files themselves and report damage
in their own terms, or not at all: a JSON error with no file name ("expected value at line
1 column 1"), a ``UnicodeDecodeError`` traceback, a ``TypeError`` from deep inside a
constructor -- and silently, a key given twice in ``tokenizer_config.json`` (the last one
wins) or a token on two lines of ``vocab.txt`` (its first id can never be produced, so
the model sees other ids than it was trained with). ``check_tokenizer_files`` reads every
tokenizer file of a folder (or one ``tokenizer.json``) with ``files.text`` and
``files.structured`` first, so each of those is one line naming the file, the line and
column where they exist, and the fix:

==========================================================  ==============================
file                                                        read as
==========================================================  ==============================
``tokenizer.json``, ``tokenizer_config.json``,              JSON: encoding, empty,
``special_tokens_map.json``, ``added_tokens.json``,         truncated, duplicate keys (both
``vocab.json`` (BPE), ``preprocessor_config.json``          positions), top level an object
``vocab.txt`` (WordPiece), ``merges.txt`` (BPE)             text: encoding, empty; a token
                                                            on two lines of vocab.txt
``tokenizer.model``, ``spiece.model`` (sentencepiece)       binary: not empty
==========================================================  ==============================

UTF-16/32 files with a byte-order mark decode (``files.text``) but the libraries read
UTF-8 only, so they are named with the conversion to run. A parse takes a few ms per MB.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.files.structured import load_json
from meshtrain.files.text import bom_encoding, read_bytes, read_text

JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "preprocessor_config.json",
)
TEXT_FILES = ("vocab.txt", "merges.txt")
BINARY_FILES = ("tokenizer.model", "spiece.model")
NAMES = JSON_FILES + TEXT_FILES + BINARY_FILES


def _not_utf8(path: Path, error: type[MeshtrainError], what: str, fix: str) -> None:
    with open(path, "rb") as f:
        enc, _ = bom_encoding(f.read(4))
    if enc != "utf-8":
        up = enc.upper().replace("-LE", "LE").replace("-BE", "BE")
        raise error(
            f"{path}: the {what} is {up} (it starts with a {up} byte-order mark); tokenizer "
            f"libraries read UTF-8 only: convert it (`iconv -f {up} -t UTF-8 {path.name} > "
            f"{path.name}.utf8`, then rename it back), or {fix}"
        )


def _check_vocab_lines(path: Path, text: str, error: type[MeshtrainError], fix: str) -> None:
    """A WordPiece vocab: line i is the token of id i-1, so a token twice is two ids."""
    lines = text.split("\n")  # as the tokenizers read it: only \n ends a line
    if lines and lines[-1] == "":
        lines.pop()
    seen: dict[str, int] = {}
    for i, line in enumerate(lines, start=1):
        token = line.rstrip("\r")
        first = seen.setdefault(token, i)
        if first != i:
            raise error(
                f"{path}: token {token!r} at line {i} is already at line {first}; the tokenizer "
                f"keeps only one id for it, so id {first - 1} or {i - 1} can never be "
                f"produced and the ids no longer match the model's: {fix}"
            )


def tokenizer_file_paths(path: str | os.PathLike) -> list[Path]:
    """The tokenizer files this module checks: in a folder, those of ``NAMES`` it holds;
    a file is itself (a ``tokenizer.json``, a ``vocab.txt``, ...)."""
    path = Path(path)
    if path.is_dir():
        return [path / n for n in NAMES if (path / n).is_file()]
    return [path] if path.is_file() else []


def check_tokenizer_files(
    path: str | os.PathLike,
    error: type[MeshtrainError],
    *,
    fix: str = "save the tokenizer again with tokenizer.save_pretrained",
) -> list[Path]:
    """Read every tokenizer file at ``path`` (a folder or one file) through the one reading
    path; raise ``error`` naming the file, line and column and ``fix`` for the first that
    is damaged. Returns the files checked."""
    files = tokenizer_file_paths(path)
    for f in files:
        name = f.name
        if name in BINARY_FILES:
            read_bytes(f, error, "tokenizer model")
            if f.stat().st_size == 0:
                raise error(f"{f}: the tokenizer model is empty (0 bytes): a truncated copy; {fix}")
            continue
        what = "tokenizer vocabulary" if name in TEXT_FILES else "tokenizer file"
        if name in TEXT_FILES:
            text = read_text(f, error, what=what, empty_fix=fix)  # encoding, empty: by position
            _not_utf8(f, error, what, fix)
            if name == "vocab.txt":
                _check_vocab_lines(f, text, error, fix)
            continue
        data = load_json(f, error, what=what, fix=fix, empty_fix=fix)
        _not_utf8(f, error, what, fix)
        if not isinstance(data, dict):
            raise error(f"{f}: expected a JSON object, got a {type(data).__name__}; {fix}")
    return files


__all__ = ["NAMES", "check_tokenizer_files", "tokenizer_file_paths"]
