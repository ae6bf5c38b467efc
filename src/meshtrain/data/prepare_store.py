"""Tokenize once, in parallel, into a memory-mapped token store.

``prepare(inputs, tokenizer, out)`` reads JSONL, CSV/TSV, plain-text files (``.gz`` too)
or a ``datasets.Dataset``, tokenizes with ``workers`` processes and writes the store
described in :mod:`meshtrain.data.layout`.

* **Once.** The store's ``content_hash`` covers the input bytes (or a dataset's
  fingerprint), the tokenizer's fingerprint and every option that changes the output. If
  ``out`` already holds a complete store with the same hash, it is reused and nothing is
  tokenized (only the inputs are read, to hash them).
* **Parallel.** Workers parse and tokenize byte ranges of uncompressed JSONL/text files;
  other inputs are parsed in the main process and workers tokenize the texts. At most
  ``2 * workers`` chunks are in flight and results are written in input order, so memory
  stays flat and the store is identical for any worker count.
* **Bad rows.** Empty or missing text is skipped and counted. Malformed JSON/CSV, a text
  that is not a string or a label that is not an integer raises :class:`DataError` naming
  file and line — unless ``skip_bad_rows``, which skips, counts and reports them.
* **Packing** (``pack=True, seq_len=L``): documents are concatenated with EOS after each
  and read as ``L``-token rows. Without packing, ``seq_len`` truncates each document.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from meshtrain.data import layout, readers
from meshtrain.data.integrity import intact
from meshtrain.data.tokenizer import as_tokenizer, token_dtype
from meshtrain.errors import DataError
from meshtrain.files.writable import check_writable
from meshtrain.forking import heap_frozen

log = logging.getLogger("meshtrain.data")
MAX_BAD_REPORTED = 20


@dataclass
class PrepareResult:
    """What ``prepare`` did; ``summary()`` is the line the CLI prints."""

    out: str
    reused: bool
    rows_read: int
    skipped_empty: int
    skipped_bad: int
    docs: int
    tokens: int
    seconds: float
    files: list[str] = field(default_factory=list)
    bad_rows: list[str] = field(default_factory=list)
    content_hash: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        if self.reused:
            return (
                f"reused {self.out} (same content hash, nothing tokenized): {self.docs:,} documents, "
                f"{self.tokens:,} tokens in {len(self.files)} files, checked in {self.seconds:.2f}s"
            )
        return (
            f"prepared {self.out}: {self.rows_read:,} rows read, {self.skipped_empty:,} skipped empty, "
            f"{self.skipped_bad:,} skipped bad, {self.docs:,} documents, {self.tokens:,} tokens "
            f"written to {len(self.files)} files in {self.seconds:.2f}s ({self.tokens_per_s:,.0f} tokens/s)"
        )


@dataclass
class _Params:
    fmt_text_field: str
    label_field: str | None
    add_special_tokens: bool
    append_eos: bool
    max_length: int | None
    stop_at_bad: bool


# -- worker side -------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, params: _Params) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
    _WORKER["tokenizer"] = tokenizer
    _WORKER["params"] = params


def _run_task(task: tuple) -> tuple:
    return _do_task(task, _WORKER["tokenizer"], _WORKER["params"])


def _do_task(task: tuple, tokenizer: Any, p: _Params) -> tuple:
    """Parse (for byte ranges) and tokenize one chunk. Returns
    ``(input_index, relative_lines, tokens, lengths, labels, lines, empty, bad)``."""
    kind, index = task[0], task[1]
    if kind == "range":
        _, _, path, fmt, start, end = task
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        rows = readers.parse_lines(data, fmt, p.fmt_text_field, p.label_field, p.stop_at_bad)
    else:
        rows = task[2]
    tokens, lengths = _encode(tokenizer, rows.texts, p)
    return (index, kind == "range", tokens, lengths, rows.labels, rows.lines, rows.empty, rows.bad)


def _encode(tok: Any, texts: list[str], p: _Params) -> tuple[np.ndarray, np.ndarray]:
    if p.max_length is not None:
        budget = p.max_length - (1 if p.append_eos else 0)
        docs = tok.encode_batch(texts, p.add_special_tokens)
        docs = [d[:budget] + ([tok.eos_id] if p.append_eos else []) for d in docs]
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        return np.fromiter(chain.from_iterable(docs), np.int64, int(lengths.sum())), lengths
    return tok.encode_to_arrays(texts, p.add_special_tokens, p.append_eos)


# -- main side ---------------------------------------------------------------------------
def _input_name(item: Any) -> str:
    return os.fspath(item) if isinstance(item, str | os.PathLike) else f"<{type(item).__name__}>"


def _content_hash(inputs: Sequence[Any], config: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for item in inputs:
        if isinstance(item, str | os.PathLike):
            path = os.fspath(item)
            if not os.path.isfile(path):
                raise DataError(f"input {path!r} does not exist or is not a file; check the path")
            with open(path, "rb") as f:
                while block := f.read(1 << 23):
                    h.update(block)
            h.update(f"\x00file-end:{readers.detect_format(path)}".encode())
        else:
            fp = getattr(item, "_fingerprint", None)
            if fp is None:  # a plain dict of columns, or a dataset without a fingerprint
                fp = hashlib.sha256(
                    repr(item[:] if hasattr(item, "column_names") else item).encode()
                ).hexdigest()
            h.update(f"dataset:{fp}".encode())
    return h.hexdigest()


def _tasks(inputs: Sequence[Any], p: _Params, chunk_bytes: int, batch_rows: int) -> Iterator[tuple]:
    for index, item in enumerate(inputs):
        if not isinstance(item, str | os.PathLike):
            for rows in readers.iter_dataset_rows(
                item, p.fmt_text_field, p.label_field, batch_rows
            ):
                yield ("rows", index, rows)
            continue
        path = os.fspath(item)
        fmt = readers.detect_format(path)
        if readers.is_splittable(path, fmt):
            for start, end in readers.split_ranges(path, chunk_bytes):
                yield ("range", index, path, fmt, start, end)
        else:
            for rows in readers.iter_main_rows(
                path, fmt, p.fmt_text_field, p.label_field, batch_rows
            ):
                yield ("rows", index, rows)


def _results(
    tasks: Iterator[tuple], tokenizer: Any, p: _Params, workers: int, start_method: str | None
) -> Iterator[tuple]:
    if workers <= 1:
        for task in tasks:
            yield _do_task(task, tokenizer, p)
        return
    method = start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    with heap_frozen():  # the workers fork here (meshtrain.forking says why)
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer, p))
    with pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(_run_task, (task,)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def prepare(
    inputs: str | os.PathLike[str] | Any | Sequence[Any],
    tokenizer: Any,
    out: str | os.PathLike[str],
    *,
    text_field: str = "text",
    label_field: str | None = None,
    workers: int | None = None,
    seq_len: int | None = None,
    pack: bool = False,
    skip_bad_rows: bool = False,
    add_special_tokens: bool | None = None,
    append_eos: bool | None = None,
    progress: bool | None = None,
    force: bool = False,
    chunk_bytes: int | None = None,
    start_method: str | None = None,
) -> PrepareResult:
    """Tokenize ``inputs`` into a token store in ``out`` (or reuse the one there).

    Args:
        inputs: a path or a list of paths (JSONL/JSON, CSV/TSV, text; ``.gz`` allowed) and/or
            ``datasets.Dataset`` objects.
        tokenizer: ``"byte"``, a ``save_pretrained`` folder, a ``tokenizer.json`` file, a
            cached hub name, or a tokenizer object (see :func:`as_tokenizer`).
        out: the store folder.
        text_field: JSON key / CSV column / dataset column holding the text.
        label_field: optional integer label per row, stored in ``labels.bin``.
        workers: tokenizing processes (default: CPU count; 1 runs in this process).
        seq_len: with ``pack``, the row length; without, documents are truncated to it.
        pack: causal-LM packing: EOS after each document, rows of ``seq_len`` tokens.
        skip_bad_rows: skip and count malformed rows instead of raising.
        add_special_tokens: tokenizer specials around each document (default: not packing).
        append_eos: EOS after each document (default: packing).
        progress: tqdm bar (default: when stderr is a terminal).
        force: rebuild even if a store with the same content hash exists.
        chunk_bytes: byte range per worker task for JSONL/text (default: size-based).
        start_method: multiprocessing start method (default: fork where available).
    """
    t0 = time.perf_counter()
    items = (
        [inputs]
        if isinstance(inputs, str | os.PathLike) or not isinstance(inputs, Sequence)
        else list(inputs)
    )
    if not items:
        raise DataError("prepare needs at least one input file or dataset")
    if pack and not seq_len:
        raise DataError("--pack needs --seq-len L: the length of the packed rows")
    if seq_len is not None and seq_len < 1:
        raise DataError(f"--seq-len must be >= 1, got {seq_len}")
    if pack and label_field:
        raise DataError("--label-field cannot be combined with --pack (packed rows mix documents)")
    out = os.fspath(out)
    tok = as_tokenizer(tokenizer)
    params = _Params(
        fmt_text_field=text_field,
        label_field=label_field,
        add_special_tokens=(not pack) if add_special_tokens is None else bool(add_special_tokens),
        append_eos=pack if append_eos is None else bool(append_eos),
        max_length=None if pack else seq_len,
        stop_at_bad=not skip_bad_rows,
    )
    config = {
        "format_version": layout.VERSION,
        "tokenizer": tok.fingerprint(),
        "seq_len": seq_len,
        "pack": pack,
        **{k: v for k, v in asdict(params).items() if k != "stop_at_bad"},
    }
    content_hash = _content_hash(items, config)
    reused = None if force else _reuse(out, content_hash, t0)
    if reused is not None:
        log.info(reused.summary())
        return reused

    check_writable(out, DataError, what="token store folder", flag="--out")
    workers = (os.cpu_count() or 1) if workers is None else max(1, int(workers))
    total_bytes = sum(
        os.path.getsize(os.fspath(i)) for i in items if isinstance(i, str | os.PathLike)
    )
    chunk = chunk_bytes or int(min(16 << 20, max(256 << 10, total_bytes // (workers * 8) + 1)))
    writer = layout.StoreWriter(
        out, token_dtype(tok.vocab_size), tok.vocab_size, params.label_field is not None
    )
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm.auto import tqdm

    bar = tqdm(desc="tokenizing", unit=" rows", disable=not show, dynamic_ncols=True)
    rows_read = empty = 0
    bad_rows: list[str] = []
    lines_before = [0] * len(items)
    results = _results(_tasks(items, params, chunk, 2048), tok, params, workers, start_method)
    try:
        for index, relative, tokens, lengths, labels, lines, n_empty, bad in results:
            name = _input_name(items[index])
            for line, reason in bad:
                line = line + lines_before[index] if relative else line
                where = (
                    f"{name}:{line}"
                    if isinstance(items[index], str | os.PathLike)
                    else f"{name} row {line}"
                )
                if not skip_bad_rows:
                    raise DataError(
                        f"{where}: {reason}; fix the row, or pass --skip-bad-rows to skip and count it"
                    )
                bad_rows.append(f"{where}: {reason}")
            lines_before[index] += lines
            rows_read += lines
            empty += n_empty
            writer.append(tokens, lengths, labels if params.label_field is not None else None)
            bar.update(lines)
    except BaseException:
        writer.abort()
        raise
    finally:
        results.close()  # stops the worker pool now, not when the traceback is freed
        bar.close()
    if writer.num_docs == 0:
        writer.abort()
        raise DataError(
            f"no row of {[_input_name(i) for i in items]} had a non-empty {text_field!r} "
            f"({rows_read} rows read, {empty} empty or missing, {len(bad_rows)} bad); "
            "check --text-field"
        )
    seconds = time.perf_counter() - t0
    meta = writer.close(
        {
            "content_hash": content_hash,
            "tokenizer": tok.name,
            "tokenizer_fingerprint": config["tokenizer"],
            "pad_id": tok.pad_id,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id,
            "seq_len": seq_len,
            "pack": bool(pack),
            "text_field": text_field,
            "label_field": params.label_field,
            "inputs": [_input_name(i) for i in items],
            "stats": {
                "rows_read": rows_read,
                "skipped_empty": empty,
                "skipped_bad": len(bad_rows),
                "seconds": round(seconds, 3),
                "workers": workers,
            },
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )
    result = _result_from_meta(out, meta, reused=False, seconds=seconds, bad_rows=bad_rows)
    if bad_rows:
        shown = "\n  ".join(bad_rows[:MAX_BAD_REPORTED])
        more = (
            f"\n  ... and {len(bad_rows) - MAX_BAD_REPORTED} more"
            if len(bad_rows) > MAX_BAD_REPORTED
            else ""
        )
        log.warning("skipped %d bad rows:\n  %s%s", len(bad_rows), shown, more)
    log.info(result.summary())
    return result


def _files(out: str, meta: dict[str, Any]) -> list[str]:
    names = (
        [layout.TOKENS, layout.OFFSETS]
        + ([layout.LABELS] if meta.get("has_labels") else [])
        + [layout.META]
    )
    return [os.path.join(out, n) for n in names]


def _result_from_meta(
    out: str, meta: dict[str, Any], reused: bool, seconds: float, bad_rows: list[str]
) -> PrepareResult:
    stats = meta.get("stats", {})
    return PrepareResult(
        out=out,
        reused=reused,
        rows_read=int(stats.get("rows_read", 0)),
        skipped_empty=int(stats.get("skipped_empty", 0)),
        skipped_bad=int(stats.get("skipped_bad", 0)),
        docs=int(meta["num_docs"]),
        tokens=int(meta["num_tokens"]),
        seconds=seconds,
        files=_files(out, meta),
        bad_rows=bad_rows,
        content_hash=str(meta.get("content_hash", "")),
    )


def _reuse(out: str, content_hash: str, t0: float) -> PrepareResult | None:
    if not os.path.isfile(os.path.join(out, layout.META)):
        return None
    try:
        meta = layout.read_meta(out)
    except DataError:
        return None  # incomplete or foreign: rebuild
    if meta.get("content_hash") != content_hash:
        return None
    if not intact(out, meta, log):  # same inputs, but the store's bytes may be damaged
        return None
    return _result_from_meta(out, meta, reused=True, seconds=time.perf_counter() - t0, bad_rows=[])
