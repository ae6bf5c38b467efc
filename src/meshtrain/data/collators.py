"""Collators: turn a list of examples into a padded batch of tensors.

Each collator is a small picklable callable (usable as ``collate_fn`` with DataLoader
workers) taking ``list[dict]`` — what a torch ``Dataset``, a ``datasets.Dataset`` or a
:class:`~meshtrain.data.store.TokenDataset` yields — and returning ``dict[str, Tensor]``.
Ids come from a tokenizer (anything :func:`~meshtrain.data.tokenizer.as_tokenizer`
accepts) or are passed explicitly.

Conventions (those of Hugging Face ``transformers``): padding goes to the longest
sequence of the batch, rounded up to ``pad_to_multiple_of``; ``attention_mask`` is 1 on
real tokens; ignored label positions are ``-100`` (cross-entropy's ``ignore_index``);
causal-LM labels are *not* shifted (the model shifts them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from meshtrain.data.tokenizer import as_tokenizer
from meshtrain.errors import DataError

IGNORE_INDEX = -100


def _as_list(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return list(x)


def padded_length(lengths: Sequence[int], multiple: int | None) -> int:
    longest = max(lengths, default=0)
    if multiple:
        longest = -(-longest // multiple) * multiple
    return longest


def pad(seqs: Sequence[Any], value: int, length: int, side: str = "right") -> torch.Tensor:
    """Stack ``seqs`` into a ``[batch, length]`` long tensor filled with ``value``."""
    out = torch.full((len(seqs), length), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        t = torch.as_tensor(_as_list(s) if not isinstance(s, torch.Tensor) else s, dtype=torch.long)
        t = t[:length]
        if side == "right":
            out[i, : len(t)] = t
        else:
            out[i, length - len(t) :] = t
    return out


def _resolve(tokenizer: Any, name: str, explicit: Any, required: bool = True) -> Any:
    if explicit is not None:
        return explicit
    if tokenizer is not None:
        value = getattr(as_tokenizer(tokenizer), name)
        if value is not None:
            return value
    if required:
        raise DataError(
            f"collator needs {name}: pass tokenizer= (with that token) or {name}= explicitly"
        )
    return None


class PaddingCollator:
    """Dynamic padding (``DataCollatorWithPadding``): pads ``input_ids`` with the pad id,
    ``attention_mask``/``token_type_ids`` with 0, token-level ``labels`` with -100; stacks
    scalar fields; renames ``label`` to ``labels``. Other ragged fields stay lists."""

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str = "right",
        label_pad_token_id: int = IGNORE_INDEX,
    ) -> None:
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        self.pad_token_id = int(_resolve(tokenizer, "pad_id", pad_token_id))
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_side = padding_side
        self.label_pad_token_id = label_pad_token_id

    def _pad_values(self) -> dict[str, int]:
        return {
            "input_ids": self.pad_token_id,
            "attention_mask": 0,
            "token_type_ids": 0,
            "special_tokens_mask": 1,
            "labels": self.label_pad_token_id,
        }

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            raise DataError("cannot collate an empty list of examples")
        features = [{("labels" if k == "label" else k): v for k, v in f.items()} for f in features]
        batch: dict[str, Any] = {}
        lengths = [len(f["input_ids"]) for f in features] if "input_ids" in features[0] else []
        length = padded_length(lengths, self.pad_to_multiple_of)
        pad_values = self._pad_values()
        for key in features[0]:
            values = [f[key] for f in features]
            first = values[0]
            if key in pad_values and _is_sequence(first):
                # labels pad to their own longest (seq2seq targets differ from inputs)
                n = (
                    length
                    if key != "labels"
                    else padded_length([len(v) for v in values], self.pad_to_multiple_of)
                )
                batch[key] = pad(values, pad_values[key], n, self.padding_side)
            elif isinstance(first, bool | int | float) or (
                isinstance(first, torch.Tensor) and first.dim() == 0
            ):
                batch[key] = torch.tensor(
                    [float(v) if isinstance(first, float) else int(v) for v in values]
                )
            elif _is_sequence(first) and len({len(v) for v in values}) == 1 and _numeric(first):
                batch[key] = torch.as_tensor([_as_list(v) for v in values])
            else:
                batch[key] = values
        if "input_ids" in batch and "attention_mask" not in batch:
            mask = torch.zeros_like(batch["input_ids"])
            for i, n in enumerate(lengths):
                if self.padding_side == "right":
                    mask[i, :n] = 1
                else:
                    mask[i, length - n :] = 1
            batch["attention_mask"] = mask
        return batch


def _is_sequence(x: Any) -> bool:
    return (
        isinstance(x, list | tuple)
        or (isinstance(x, torch.Tensor) and x.dim() >= 1)
        or (
            hasattr(x, "__array__")
            and not isinstance(x, str | bytes)
            and getattr(x, "ndim", 0) >= 1
        )
    )


def _numeric(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    items = _as_list(x)
    return all(isinstance(v, bool | int | float) for v in items[:8])


class CausalLMCollator(PaddingCollator):
    """Causal LM: pads ``input_ids`` and sets ``labels = input_ids`` with -100 on padding
    (by position, so a pad id equal to EOS does not hide real EOS tokens)."""

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        stripped = [{k: v for k, v in f.items() if k not in ("labels", "label")} for f in features]
        batch = super().__call__(stripped)
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = IGNORE_INDEX
        batch["labels"] = labels
        return batch


class Seq2SeqCollator(PaddingCollator):
    """Seq2seq: pads ``input_ids`` and, separately, ``labels`` with -100 (to the longest
    label, rounded to ``pad_to_multiple_of``). With ``decoder_start_token_id`` it also
    builds ``decoder_input_ids`` = labels shifted right, -100 replaced by the pad id."""

    def __init__(
        self, tokenizer: Any = None, *, decoder_start_token_id: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(tokenizer, **kwargs)
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(features)
        if self.decoder_start_token_id is not None and "labels" in batch:
            labels = batch["labels"]
            dec = torch.full_like(labels, self.pad_token_id)
            dec[:, 0] = self.decoder_start_token_id
            dec[:, 1:] = labels[:, :-1]
            dec[dec == self.label_pad_token_id] = self.pad_token_id
            batch["decoder_input_ids"] = dec
        return batch


class MaskedLMCollator(PaddingCollator):
    """Masked LM (BERT): each non-special, non-padding token is selected with probability
    ``mlm_probability``; of those, ``mask_replace_prob`` become the mask token,
    ``random_replace_prob`` a random id in ``[0, vocab_size)``, the rest stay. ``labels``
    hold the original id at selected positions and -100 elsewhere.

    ``generator``: a ``torch.Generator`` for reproducible masks (default: the global RNG,
    which DataLoader seeds differently in each worker)."""

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        mlm_probability: float = 0.15,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
        mask_token_id: int | None = None,
        vocab_size: int | None = None,
        special_ids: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, **kwargs)
        for name, p in (
            ("mlm_probability", mlm_probability),
            ("mask_replace_prob", mask_replace_prob),
            ("random_replace_prob", random_replace_prob),
        ):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        if mask_replace_prob + random_replace_prob > 1.0:
            raise ValueError("mask_replace_prob + random_replace_prob must be <= 1")
        self.mlm_probability = mlm_probability
        self.mask_replace_prob = mask_replace_prob
        self.random_replace_prob = random_replace_prob
        self.mask_token_id = int(_resolve(tokenizer, "mask_id", mask_token_id))
        self.vocab_size = int(_resolve(tokenizer, "vocab_size", vocab_size))
        specials = (
            special_ids
            if special_ids is not None
            else _resolve(tokenizer, "special_ids", None, False)
        )
        self.special_ids = sorted(
            {int(i) for i in (specials or ())} | {self.pad_token_id, self.mask_token_id}
        )
        self.generator = generator

    def _bernoulli(self, shape: torch.Size, p: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator) < p

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        stripped = [{k: v for k, v in f.items() if k not in ("labels", "label")} for f in features]
        batch = super().__call__(stripped)
        ids = batch["input_ids"]
        if "special_tokens_mask" in batch:
            special = batch.pop("special_tokens_mask").bool()
        else:
            special = torch.isin(ids, torch.tensor(self.special_ids, dtype=torch.long))
        candidates = ~special & (batch["attention_mask"] == 1)
        selected = self._bernoulli(ids.shape, self.mlm_probability) & candidates
        labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
        to_mask = self._bernoulli(ids.shape, self.mask_replace_prob) & selected
        rest = 1.0 - self.mask_replace_prob
        p_random = self.random_replace_prob / rest if rest > 0 else 0.0
        to_random = self._bernoulli(ids.shape, p_random) & selected & ~to_mask
        ids = ids.clone()
        ids[to_mask] = self.mask_token_id
        random_ids = torch.randint(
            self.vocab_size, ids.shape, generator=self.generator, dtype=torch.long
        )
        ids[to_random] = random_ids[to_random]
        batch["input_ids"] = ids
        batch["labels"] = labels
        return batch


class TokenClassificationCollator(PaddingCollator):
    """Token classification (NER): word labels aligned to sub-tokens.

    Accepts examples with pre-split words (``words_field``, default ``"tokens"``) and one
    label per word (``label_field``), which it tokenizes; or ``input_ids`` + ``word_ids``
    + word labels; or ``input_ids`` + labels already aligned to tokens. Special tokens get
    -100; the first sub-token of a word gets the word's label; later sub-tokens get -100,
    or with ``label_all_tokens`` the word's label mapped through ``subtoken_label_map``
    (e.g. B-X -> I-X). ``max_length`` truncates, keeping a final special token."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        label_all_tokens: bool = False,
        subtoken_label_map: Mapping[int, int] | None = None,
        words_field: str = "tokens",
        label_field: str = "labels",
        max_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, **kwargs)
        self.tokenizer = as_tokenizer(tokenizer)
        self.label_all_tokens = label_all_tokens
        self.subtoken_label_map = dict(subtoken_label_map or {})
        self.words_field = words_field
        self.label_field = label_field
        self.max_length = max_length

    def align(self, word_ids: Sequence[int | None], word_labels: Sequence[int]) -> list[int]:
        """Token labels for ``word_ids`` (None = special token) from per-word labels."""
        out: list[int] = []
        previous: int | None = None
        for w in word_ids:
            if w is None:
                out.append(IGNORE_INDEX)
            elif w != previous:
                out.append(int(word_labels[w]))
            elif self.label_all_tokens:
                label = int(word_labels[w])
                out.append(self.subtoken_label_map.get(label, label))
            else:
                out.append(IGNORE_INDEX)
            previous = w
        return out

    def _example(self, f: Mapping[str, Any]) -> dict[str, Any]:
        labels = _as_list(f[self.label_field])
        if self.words_field in f and "input_ids" not in f:
            ids, word_ids = self.tokenizer.encode_words(list(f[self.words_field]))
            labels = self.align(word_ids, labels)
        elif "word_ids" in f:
            ids = _as_list(f["input_ids"])
            labels = self.align(list(f["word_ids"]), labels)
        else:
            ids = _as_list(f["input_ids"])
            if len(labels) != len(ids):
                raise DataError(
                    f"token labels ({len(labels)}) do not match input_ids ({len(ids)}); give "
                    f"'{self.words_field}' or 'word_ids' with word-level labels to align them"
                )
        if self.max_length is not None and len(ids) > self.max_length:
            keep_last = labels[-1] == IGNORE_INDEX and ids[-1] in self.tokenizer.special_ids
            cut = self.max_length - (1 if keep_last else 0)
            ids = ids[:cut] + (ids[-1:] if keep_last else [])
            labels = labels[:cut] + (labels[-1:] if keep_last else [])
        return {"input_ids": ids, "labels": labels}

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return super().__call__([self._example(f) for f in features])
