"""Bytes to text, one way for every input file: encodings and empty files named.

Accepted: UTF-8 with or without a byte-order mark, and UTF-16/UTF-32 *with* a BOM (what
Windows editors write as "Unicode"), decoded with the BOM and then handled as UTF-8 text:
``decode`` for a whole file, ``utf8_stream`` for a file read line by line (a data file
too large to hold), which re-encodes it to UTF-8 as it is read. Refused with file, line, column and the fix in one
line (``FILE: problem at line L, column C; fix``): bytes that are not UTF-8 (a Latin-1 or Windows-1252 file), UTF-16 without a BOM
(NUL bytes every other byte), and an empty file (a truncated copy or the wrong path).
"""

from __future__ import annotations

import codecs
import io
import os
from typing import BinaryIO

from meshtrain.errors import MeshtrainError

_BOMS = (  # longest first: the UTF-32 LE BOM starts with the UTF-16 LE one
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_CONVERT = "re-save it as UTF-8 (e.g. `iconv -f {enc} -t UTF-8 FILE > FILE.utf8`)"


def line_col(data: bytes | str, pos: int) -> tuple[int, int]:
    """1-based line and column of offset ``pos`` in ``data``."""
    nl = b"\n" if isinstance(data, bytes) else "\n"
    line = data.count(nl, 0, pos) + 1
    return line, pos - (data.rfind(nl, 0, pos) + 1) + 1


def read_bytes(path: str | os.PathLike, error: type[MeshtrainError], what: str = "file") -> bytes:
    """The bytes of ``path``; a missing or unreadable file raises ``error`` naming it."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise error(f"{path}: no such {what}; check the path") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a {what}; pass the file inside it") from None
    except OSError as exc:
        raise error(
            f"{path}: cannot read the {what} ({exc.strerror or exc}); check its permissions"
        ) from None


def decode(
    raw: bytes,
    where: str,
    error: type[MeshtrainError],
    *,
    what: str = "file",
    allow_empty: bool = False,
    empty_fix: str = "write its content, or check the path",
) -> str:
    """``raw`` as text (BOM removed); ``error`` with ``where:line:col`` when it is not."""
    if not raw and not allow_empty:
        raise error(
            f"{where}: the {what} is empty (0 bytes): a truncated copy or the wrong path; "
            f"{empty_fix}"
        )
    encoding = "utf-8"
    for bom, enc in _BOMS:
        if raw.startswith(bom):
            raw, encoding = raw[len(bom) :], enc
            break
    if encoding == "utf-8" and len(raw) >= 2 and b"\x00" in raw[:64]:
        # NUL bytes in text: UTF-16/32 without a BOM, or a binary file given by mistake
        enc = "UTF-16LE" if raw[1:2] == b"\x00" else "UTF-16BE" if raw[:1] == b"\x00" else None
        if enc is not None and raw.count(b"\x00") * 3 >= len(raw):
            raise error(
                f"{where}: the {what} looks like {enc} without a byte-order mark; "
                + _CONVERT.format(enc=enc)
            )
        pos = raw.index(b"\x00")
        line, col = line_col(raw, pos)
        raise error(
            f"{where}: a NUL byte at line {line}, column {col}: this is a binary file, not a "
            f"text {what}; pass the text file"
        )
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        line, col = line_col(raw, exc.start)
        bad = raw[exc.start : exc.start + 1].hex()
        raise error(
            f"{where}: byte 0x{bad} at line {line}, column {col} is not valid {encoding.upper()} "
            f"(the {what} is in another encoding, e.g. Latin-1 or Windows-1252); "
            + _CONVERT.format(enc="LATIN1" if encoding == "utf-8" else encoding.upper())
        ) from None


def read_text(
    path: str | os.PathLike,
    error: type[MeshtrainError],
    *,
    what: str = "file",
    allow_empty: bool = False,
    empty_fix: str = "write its content, or check the path",
) -> str:
    """Read and decode ``path`` (see :func:`decode`)."""
    raw = read_bytes(path, error, what)
    return decode(
        raw, os.fspath(path), error, what=what, allow_empty=allow_empty, empty_fix=empty_fix
    )


def bom_encoding(head: bytes) -> tuple[str, int]:
    """``(encoding, BOM length)`` from a file's first bytes; ``("utf-8", 0)`` without one."""
    for bom, enc in _BOMS:
        if head.startswith(bom):
            return enc, len(bom)
    return "utf-8", 0


class _Recoded(io.RawIOBase):
    """UTF-8 bytes of a UTF-16/32 stream (positioned past its BOM), decoded incrementally;
    bytes that are not valid in that encoding raise ``error`` with the file offset and line."""

    def __init__(
        self, raw: BinaryIO, encoding: str, skip: int, where: str, error: type, what: str
    ) -> None:
        self._raw, self._enc, self._where, self._error, self._what = (
            raw,
            encoding,
            where,
            error,
            what,
        )
        self._dec = codecs.getincrementaldecoder(encoding)("strict")
        self._out = b""
        self._offset = skip  # file offset of the next raw byte
        self._lines = 0  # newlines decoded so far
        self._eof = False

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._raw.close()  # the stream owns the file it recodes
        super().close()

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._out and not self._eof:
            chunk = self._raw.read(1 << 16)
            pending = self._dec.getstate()[0]
            try:
                text = self._dec.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                data = pending + chunk
                good = data[: exc.start].decode(self._enc, errors="replace")
                pos = self._offset - len(pending) + exc.start
                enc = self._enc.upper()
                raise self._error(
                    f"{self._where}: bytes at offset {pos} (line "
                    f"{self._lines + good.count(chr(10)) + 1}) are not valid {enc} "
                    f"({exc.reason}): the {self._what} starts with a {enc} byte-order mark but "
                    f"is damaged or partly in another encoding; "
                    + _CONVERT.format(enc=enc.replace("-LE", "LE").replace("-BE", "BE"))
                ) from None
            self._offset += len(chunk)
            self._eof = not chunk
            self._lines += text.count("\n")
            self._out = text.encode("utf-8")
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


def utf8_stream(
    f: BinaryIO, where: str, error: type[MeshtrainError], *, what: str = "file"
) -> BinaryIO:
    """``f`` (a binary file at its start) as a stream of UTF-8 bytes: a UTF-8 BOM skipped,
    UTF-16/32 with a BOM decoded and re-encoded as it is read, so line-by-line readers
    handle every accepted encoding as UTF-8. Costs nothing for a UTF-8 file (the same
    stream, past its BOM)."""
    enc, skip = bom_encoding(f.read(4))
    f.seek(skip)
    if enc == "utf-8":
        return f
    return io.BufferedReader(_Recoded(f, enc, skip, where, error, what), 1 << 16)  # type: ignore[return-value]
