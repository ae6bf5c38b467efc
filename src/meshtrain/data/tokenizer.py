"""Tokenizers the data pipeline understands: a built-in byte-level one and Hugging Face ones.

Everything in ``meshtrain.data`` talks to a tokenizer through the small interface of
:class:`ByteTokenizer` (``encode``, ``encode_batch``, ``encode_words``, ``decode`` and the
ids ``pad_id``, ``eos_id``, ``bos_id``, ``mask_id``, ``special_ids``, ``vocab_size``,
``fingerprint()``). :func:`as_tokenizer` turns a name, a path, a ``transformers`` tokenizer
or a ``tokenizers.Tokenizer`` into an object with that interface, so collators and
``prepare`` accept whatever the user already has.

Both kinds pickle cheaply: the byte tokenizer has no state, and a Hugging Face tokenizer
loaded from a name or path pickles as that name and is loaded again in each worker
process. ``transformers`` and ``tokenizers`` are imported only when such a tokenizer is
actually used.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from meshtrain.errors import DataError
from meshtrain.files.tokenizer_files import check_tokenizer_files

BYTE_TOKENIZER_NAMES = ("byte", "bytes", "byte-level")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus ``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258,
    ``<mask>`` 259 (vocabulary size 260, stored as uint16).

    No vocabulary file, no dependency, picklable, and fast enough to tokenize millions of
    rows in tests. ``add_special_tokens=True`` wraps a text as ``<bos> ... <eos>``.
    """

    name = "byte"
    pad_id = 256
    bos_id = 257
    eos_id = 258
    mask_id = 259
    vocab_size = 260

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.pad_id, self.bos_id, self.eos_id, self.mask_id))

    def __len__(self) -> int:
        return self.vocab_size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)

    def fingerprint(self) -> str:
        return "meshtrain-byte-v1"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids, self.eos_id] if add_special_tokens else ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def encode_words(
        self, words: Sequence[str], add_special_tokens: bool = True
    ) -> tuple[list[int], list[int | None]]:
        """Token ids of pre-split words and, per token, the index of its word (None for
        special tokens). Words are joined with a space token that belongs to the next word."""
        ids: list[int] = [self.bos_id] if add_special_tokens else []
        word_ids: list[int | None] = [None] if add_special_tokens else []
        for i, word in enumerate(words):
            piece = (" " + word if i else word).encode("utf-8")
            ids.extend(piece)
            word_ids.extend([i] * len(piece))
        if add_special_tokens:
            ids.append(self.eos_id)
            word_ids.append(None)
        return ids, word_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(int(i) for i in ids if int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def encode_to_arrays(
        self, texts: Sequence[str], add_special_tokens: bool, append_eos: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fast path for ``prepare``: all texts as one flat uint16 array plus lengths."""
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint16)
        if add_special_tokens:
            starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(lengths) else lengths
            flat = np.insert(flat, starts, self.bos_id)
            ends = np.cumsum(lengths + 1)
            flat = np.insert(flat, ends, self.eos_id)
            lengths = lengths + 2
        if append_eos:
            flat = np.insert(flat, np.cumsum(lengths), self.eos_id)
            lengths = lengths + 1
        return flat, lengths


def _first_id(tok: Any, names: Sequence[str]) -> int | None:
    vocab = tok.get_vocab()
    for name in names:
        if name in vocab:
            return int(vocab[name])
    return None


class HFTokenizer:
    """Adapter over a ``transformers`` tokenizer (or a ``tokenizers.Tokenizer``, wrapped in
    ``PreTrainedTokenizerFast``) exposing the :class:`ByteTokenizer` interface.

    ``eos_id`` falls back to ``[SEP]`` and ``bos_id`` to ``[CLS]`` for BERT-style
    vocabularies, so document packing and chat rendering work with them too.
    """

    def __init__(self, tokenizer: Any, source: str | None = None) -> None:
        if _is_raw_tokenizers(tokenizer):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        self.tok = tokenizer
        self.source = source
        self.name = source or type(tokenizer).__name__
        self._init_ids()

    def _init_ids(self) -> None:
        tok = self.tok
        self.pad_id = tok.pad_token_id
        if self.pad_id is None:
            self.pad_id = _first_id(tok, ("[PAD]", "<pad>", "<|pad|>"))
        self.eos_id = tok.eos_token_id
        if self.eos_id is None:
            self.eos_id = tok.sep_token_id
        if self.eos_id is None:
            self.eos_id = _first_id(tok, ("</s>", "<|endoftext|>", "<eos>", "[SEP]", "<|eos|>"))
        self.bos_id = tok.bos_token_id if tok.bos_token_id is not None else tok.cls_token_id
        self.mask_id = tok.mask_token_id
        if self.mask_id is None:
            self.mask_id = _first_id(tok, ("[MASK]", "<mask>"))
        if self.pad_id is None:
            self.pad_id = self.eos_id
        special = set(tok.all_special_ids)
        special.update(
            i for i in (self.pad_id, self.eos_id, self.bos_id, self.mask_id) if i is not None
        )
        self.special_ids = frozenset(special)
        self.vocab_size = len(tok)

    def __len__(self) -> int:
        return self.vocab_size

    def __getstate__(self) -> dict[str, Any]:
        # Loaded from a name/path: each worker loads it again instead of unpickling it.
        if self.source is not None:
            return {"source": self.source}
        return {"source": None, "tok": self.tok}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["source"] is not None:
            loaded = load_tokenizer(state["source"])
            self.__dict__.update(loaded.__dict__)
        else:
            self.__init__(state["tok"])  # type: ignore[misc]

    def fingerprint(self) -> str:
        tok = self.tok
        h = hashlib.sha256(type(tok).__name__.encode())
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            h.update(backend.to_str().encode("utf-8"))
        else:
            h.update(json.dumps(sorted(tok.get_vocab().items())).encode("utf-8"))
        h.update(json.dumps(sorted(self.special_ids)).encode())
        return "hf-" + h.hexdigest()[:32]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        backend = self._backend()
        if backend is None:  # a slow (pure Python) tokenizer
            return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        # the Rust tokenizer's single encode, as encode_batch below: the ids of
        # transformers' __call__ without its Python around them, and without the thread
        # pool a batch call hands work to (a server encodes a few short pieces per request)
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` behind a fast tokenizer (truncation and padding
        off, as transformers' __call__ sets them for one unpadded text), or None."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            if backend.truncation is not None:
                backend.no_truncation()
            if backend.padding is not None:
                backend.no_padding()
        return backend

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        if not texts:
            return []
        backend = self._backend()
        if backend is None:  # a slow (pure Python) tokenizer
            out = self.tok(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
            return [list(x) for x in out]
        # The Rust tokenizer directly, as transformers' __call__ does, without building a
        # BatchEncoding; encode_batch_fast skips character offsets (the ids are the same).
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=add_special_tokens)]

    def encode_words(
        self, words: Sequence[str], add_special_tokens: bool = True
    ) -> tuple[list[int], list[int | None]]:
        if getattr(self.tok, "is_fast", False):
            enc = self.tok(
                list(words), is_split_into_words=True, add_special_tokens=add_special_tokens
            )
            return list(enc["input_ids"]), list(enc.word_ids())
        ids: list[int] = []
        word_ids: list[int | None] = []
        for i, word in enumerate(words):
            piece = self.tok(word, add_special_tokens=False)["input_ids"]
            ids.extend(piece)
            word_ids.extend([i] * len(piece))
        if add_special_tokens:
            with_special = self.tok.build_inputs_with_special_tokens(ids)
            # Specials are only added around the sequence: find where ours start.
            lead = next(
                k for k in range(len(with_special)) if with_special[k : k + len(ids)] == ids
            )
            word_ids = [None] * lead + word_ids + [None] * (len(with_special) - lead - len(ids))
            ids = list(with_special)
        return ids, word_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_to_arrays(
        self, texts: Sequence[str], add_special_tokens: bool, append_eos: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        docs = self.encode_batch(texts, add_special_tokens)
        if append_eos:
            if self.eos_id is None:
                raise DataError(
                    f"tokenizer {self.name!r} has no end-of-sequence token to separate packed "
                    "documents; set tokenizer.eos_token, or prepare without --pack"
                )
            for d in docs:
                d.append(self.eos_id)
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(chain.from_iterable(docs), dtype=np.int64, count=int(lengths.sum()))
        return flat, lengths


def _is_raw_tokenizers(obj: Any) -> bool:
    return type(obj).__module__.startswith("tokenizers") and hasattr(obj, "encode_batch")


def load_tokenizer(name_or_path: str) -> ByteTokenizer | HFTokenizer:
    """Load a tokenizer by name: ``"byte"`` (built in), a ``save_pretrained`` folder, a
    ``tokenizer.json`` file, or a Hugging Face hub name (needs the hub cache; no download
    happens offline). Raises :class:`DataError` with the fix when it cannot be loaded."""
    if name_or_path.lower() in BYTE_TOKENIZER_NAMES:
        return ByteTokenizer()
    if os.path.exists(name_or_path):  # its files through the one reading path first
        check_tokenizer_files(
            name_or_path,
            DataError,
            fix="save the tokenizer again with tokenizer.save_pretrained, or pass another "
            "--tokenizer",
        )
    try:
        if os.path.isfile(name_or_path):
            from tokenizers import Tokenizer

            return HFTokenizer(Tokenizer.from_file(name_or_path), source=name_or_path)
        from transformers import AutoTokenizer

        if not os.path.isdir(name_or_path):
            # a hub name: the cache first; the hub only if it answers, so an offline run
            # fails at once instead of retrying an unreachable hub for a minute
            try:
                tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
                return HFTokenizer(tok, source=name_or_path)
            except ImportError:
                raise
            except Exception:  # noqa: BLE001 - not cached: decide below
                if not _hub_reachable():
                    raise DataError(_not_found(name_or_path)) from None
        return HFTokenizer(AutoTokenizer.from_pretrained(name_or_path), source=name_or_path)
    except ImportError as exc:
        raise DataError(
            f"tokenizer {name_or_path!r} needs the Hugging Face libraries ({exc}); "
            'install them with pip install "meshtrain[hf]", or use --tokenizer byte'
        ) from exc
    except DataError:
        raise
    except Exception as exc:  # OSError, ValueError, hub errors: all mean "cannot load"
        raise DataError(
            f"cannot load tokenizer {name_or_path!r}: {exc}. Pass a save_pretrained folder, a "
            "tokenizer.json file, a model name already in the Hugging Face cache, or 'byte'"
        ) from exc


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers (never, under ``HF_HUB_OFFLINE=1``)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout_s).close()
        return True
    except OSError:
        return False


def _not_found(name: str) -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE as cache
    except ImportError:
        cache = os.path.expanduser("~/.cache/huggingface/hub")
    cached = os.path.join(cache, "models--" + name.replace("/", "--"))
    return (
        f"cannot load tokenizer {name!r}: it is not a local path and not in the Hugging Face "
        f"cache, and the hub cannot be reached. Tried: {os.path.abspath(name)} (no such "
        f"folder or file), {cached} (not cached). Pass a save_pretrained folder or a "
        "tokenizer.json file, download the model once where there is network "
        f"(huggingface-cli download {name}), or use --tokenizer byte"
    )


def as_tokenizer(tokenizer: Any) -> ByteTokenizer | HFTokenizer:
    """Normalise a name/path, a ``transformers`` or ``tokenizers`` tokenizer, or one of
    ours into the interface the data pipeline uses."""
    if isinstance(tokenizer, ByteTokenizer | HFTokenizer):
        return tokenizer
    if isinstance(tokenizer, str | os.PathLike):
        return load_tokenizer(os.fspath(tokenizer))
    if _is_raw_tokenizers(tokenizer) or hasattr(tokenizer, "all_special_ids"):
        return HFTokenizer(tokenizer)
    raise DataError(
        f"unsupported tokenizer object of type {type(tokenizer).__name__}; pass a name or path, "
        "a transformers tokenizer, a tokenizers.Tokenizer, or meshtrain.data.ByteTokenizer()"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
