"""Chat fine-tuning data: ``prompt`` / ``response`` / ``history`` rendered through a template,
loss on the response only.

The records are those of the seeds (ChatGLM fine-tuning)::

    {"prompt": "...", "response": "...", "history": [["query 1", "answer 1"], ...]}

:class:`ChatTemplate` renders each history round and the current prompt to text; the
collator tokenizes the pieces separately (without special tokens), and builds::

    input_ids = [bos] + round_1 + ... + round_k + prompt + response + [eos]
    labels    = -100 ... (everything before the response) ...  response + [eos]

Truncation to ``max_length`` keeps the response: the oldest history rounds are dropped
first, then the remaining source is cut from the *left*, so the end of the prompt (the
answer cue) stays next to the response. Only a response that alone fills ``max_length``
is cut (at its end, keeping one source token), and ``max_response_length`` caps it first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain.data.collators import IGNORE_INDEX, PaddingCollator
from meshtrain.data.tokenizer import as_tokenizer
from meshtrain.errors import DataError


@dataclass(frozen=True)
class ChatTemplate:
    """How a conversation becomes text. ``{index}`` is the 0-based round number,
    ``{query}``/``{answer}`` the turn's texts; ``system`` is prepended once."""

    turn: str = "<|user|>\n{query}\n<|assistant|>\n{answer}\n"
    prompt: str = "<|user|>\n{query}\n<|assistant|>\n"
    system: str = ""

    @classmethod
    def chatglm(cls) -> ChatTemplate:
        """The ChatGLM-6B fine-tuning format used in the seeds."""
        return cls(
            turn="[Round {index}]\n问:{query}\n答:{answer}\n",
            prompt="[Round {index}]\n问:{query}\n答:",
        )

    def render(self, prompt: str, history: Sequence[Sequence[str]] = ()) -> tuple[list[str], str]:
        """(rendered history rounds, rendered current prompt)."""
        rounds = [self.turn.format(index=i, query=q, answer=a) for i, (q, a) in enumerate(history)]
        return rounds, self.prompt.format(index=len(history), query=prompt)


def _history(value: Any, where: str) -> list[tuple[str, str]]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise DataError(
            f"{where}: 'history' must be a list of [query, answer] pairs, got {type(value).__name__}"
        )
    pairs = []
    for i, item in enumerate(value):
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise DataError(f"{where}: history[{i}] = {item!r:.60} is not a [query, answer] pair")
        pairs.append((str(item[0] or ""), str(item[1] or "")))
    return pairs


class ChatCollator(PaddingCollator):
    """Tokenize, truncate and pad chat records; loss only on response tokens.

    Args:
        tokenizer: anything :func:`~meshtrain.data.tokenizer.as_tokenizer` accepts.
        template: a :class:`ChatTemplate` (default: ``<|user|>``/``<|assistant|>``;
            ``ChatTemplate.chatglm()`` for the seeds' format).
        max_length: total tokens per example, response kept (see the module docstring).
        max_response_length: cap on response tokens (including EOS).
        add_bos / add_eos: put the tokenizer's BOS first / EOS after the response.
        prompt_field / response_field / history_field: record keys.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        template: ChatTemplate | None = None,
        max_length: int | None = None,
        max_response_length: int | None = None,
        add_bos: bool = True,
        add_eos: bool = True,
        prompt_field: str = "prompt",
        response_field: str = "response",
        history_field: str = "history",
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, **kwargs)
        self.tokenizer = as_tokenizer(tokenizer)
        self.template = template or ChatTemplate()
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.max_length = max_length
        self.max_response_length = max_response_length
        self.bos = [self.tokenizer.bos_id] if add_bos and self.tokenizer.bos_id is not None else []
        if add_eos and self.tokenizer.eos_id is None:
            raise DataError(
                "the tokenizer has no EOS token; pass add_eos=False or set its eos_token"
            )
        self.eos = [self.tokenizer.eos_id] if add_eos else []
        self.fields = (prompt_field, response_field, history_field)

    def encode(self, record: Mapping[str, Any], where: str = "record") -> dict[str, list[int]]:
        """``input_ids`` and ``labels`` for one record (no padding)."""
        prompt_field, response_field, history_field = self.fields
        for name in (prompt_field, response_field):
            if name not in record or record[name] is None:
                raise DataError(
                    f"{where}: missing {name!r} (keys: {sorted(record)}); chat records need "
                    f"{prompt_field!r} and {response_field!r}"
                )
        history = _history(record.get(history_field), where)
        rounds, prompt = self.template.render(str(record[prompt_field]), history)
        enc = self.tokenizer.encode
        system = enc(self.template.system) if self.template.system else []
        round_ids = [enc(r) for r in rounds]
        prompt_ids = enc(prompt)
        response = enc(str(record[response_field])) + self.eos
        if self.max_response_length is not None:
            response = response[: self.max_response_length]
        if self.max_length is not None:
            budget = self.max_length - len(self.bos)
            response = response[: max(1, budget - 1)]
            room = budget - len(response)
            while round_ids and len(system) + sum(map(len, round_ids)) + len(prompt_ids) > room:
                round_ids.pop(0)  # oldest round first
            source = system + [t for r in round_ids for t in r] + prompt_ids
            source = source[len(source) - room :] if len(source) > room else source
        else:
            source = system + [t for r in round_ids for t in r] + prompt_ids
        head = self.bos + source
        return {"input_ids": head + response, "labels": [IGNORE_INDEX] * len(head) + response}

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        examples = [
            self.encode(f, where=f"example {i} of the batch") for i, f in enumerate(features)
        ]
        return super().__call__(examples)
