"""An answer's text as it is generated: stop strings, and what may be streamed yet.

OpenAI's ``stop`` (a string or up to 4 strings) ends an answer where its *decoded text*
first contains one of them, whatever tokens spell it (a stop string may span several
tokens, or end inside one); the answer is the text before it, the stop string itself is
not returned, and ``finish_reason`` is ``"stop"``. So the check runs on the text, after
each token: :class:`AnswerText` decodes the tokens so far and looks for the stops.

Streaming must never send text it may have to take back. A piece is sent once decoded,
except two kinds of tail that the next token may change:

* trailing U+FFFD: bytes of a character not complete yet (byte-level BPE tokens can cut
  a character; the next token completes it);
* the longest tail that is the beginning of a stop string (``"Obs"`` while ``"Observation:"``
  is a stop): it is sent only once the text goes on differently, or dropped when the stop
  completes.

At the end of an answer (EOS, length, cancelled) everything before a stop is sent. The
pieces sent always join to exactly the final answer text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

MAX_STOPS = 4  # OpenAI's limit on the number of stop strings


class AnswerText:
    """The decoded text of one answer (module docstring). ``add(token)`` after each
    generated token returns True once a stop string has appeared; ``finish()`` sends the
    rest and returns the answer text (cut before the stop)."""

    def __init__(
        self,
        tokenizer: Any,
        stops: Sequence[str] = (),
        push: Callable[[str], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.push = push  # receives each streamable piece (None: not streaming)
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already pushed
        self.stopped_at: int | None = None  # index in text where the first stop begins

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def add(self, token: int) -> bool:
        """Take one generated token; True when the text now holds a stop string."""
        if self.stopped:
            return True
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        # the whole text is searched: a token can change the last characters (it
        # completes a character), and answers are short next to the model's work
        found = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped_at = min(found)
            self._send(self.stopped_at)
            return True
        if self.push is not None:
            self._send(len(self.text) - self._held())
        return False

    def finish(self) -> str:
        """Send whatever is left (before a stop) and return the answer's text."""
        end = self.stopped_at if self.stopped else len(self.text)
        self._send(end)
        return self.text[:end]

    def _held(self) -> int:
        """Characters at the end of text that the next token may still change."""
        text = self.text
        held = len(text) - len(text.rstrip("\ufffd"))  # an incomplete character
        for stop in self.stops:  # the longest tail that begins a stop string
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if stop.startswith(text[-k:]):
                    held = k
                    break
        return held

    def _send(self, end: int) -> None:
        if self.push is not None and end > self.sent:
            self.push(self.text[self.sent : end])
            self.sent = end


class AnswerStreamer:
    """``model.generate``'s streamer interface (``put``, ``end``) over an
    :class:`AnswerText`, for the one-at-a-time path: the first ``put`` is the prompt
    (skipped), then one token per step."""

    def __init__(self, answer: AnswerText) -> None:
        self.answer = answer
        self._prompt = True

    def put(self, value: Any) -> None:
        if self._prompt:
            self._prompt = False
            return
        for token in value.reshape(-1).tolist():
            self.answer.add(int(token))

    def end(self) -> None:
        pass  # the caller calls answer.finish() once it knows how the answer ended


def normalize(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """OpenAI's ``stop`` field (a string, a list, or null) as a tuple of strings."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
