"""OpenAI's ``stop`` strings (``serve/stops.py``): the answer ends before the first stop
string in its decoded text, the stop is not returned, ``finish_reason`` is ``"stop"``,
and a stream never sends text it has to take back (a partial stop, an incomplete
character). Checked on the text logic alone, then on a live server with continuous
batching and with one ``model.generate`` at a time.

Greedy answers are compared exactly with ``model.generate`` in fp32 (as in test_chat.py).
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from meshtrain.serve.stops import AnswerText
from tests.serve.conftest import live_server


class ByteTokenizer:
    """Each token is a byte string; decoding joins them as UTF-8 with U+FFFD for bytes
    that do not (yet) form a character, as byte-level BPE decoders do. Id 0 is special."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [b"<eos>", *pieces]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        keep = [i for i in ids if not (skip_special_tokens and i == 0)]
        return b"".join(self.pieces[i] for i in keep).decode("utf-8", errors="replace")


def _run(pieces: list[bytes], stops, *, streaming: bool = True):
    tok = ByteTokenizer(pieces)
    sent: list[str] = []
    answer = AnswerText(tok, stops, sent.append if streaming else None)
    stopped = False
    for i in range(1, len(pieces) + 1):
        if answer.add(i):
            stopped = True
            break
    return answer.finish(), sent, stopped


def test_stop_spanning_tokens_is_cut_and_never_streamed():
    pieces = [b"Hel", b"lo", b" Obs", b"erv", b"ation:", b" more"]
    text, sent, stopped = _run(pieces, ["Observation:"])
    assert stopped and text == "Hello "
    assert sent == ["Hel", "lo", " "]  # "Obs", "Observ" were held back, then dropped


def test_partial_stop_that_does_not_complete_is_sent_later():
    text, sent, stopped = _run([b"a O", b"bx", b"!"], ["Obs"])
    assert not stopped and text == "a Obx!"
    assert sent == ["a ", "Obx", "!"]


def test_stop_inside_one_token_and_the_earliest_of_several():
    text, _, stopped = _run([b"xx", b"yySTOPzzENDww"], ["END", "STOP"])
    assert stopped and text == "xxyy"
    text, _, stopped = _run([b"no stop here"], ["STOP"], streaming=False)
    assert not stopped and text == "no stop here"


def test_incomplete_character_is_held_until_complete():
    # "你" is e4 bd a0: two tokens cut it
    text, sent, _ = _run([b"ok \xe4\xbd", b"\xa0!"], [])
    assert text == "ok 你!" and sent == ["ok ", "你!"]


def test_random_streams_join_to_the_answer():
    """Whatever the cut, the pieces sent join to exactly the answer, which holds no stop
    and ends where the first stop began."""
    rng = random.Random(0)
    alphabet = [b"a", b"b", b"ab", b" ", b"\xe4\xbd", b"\xa0", b"ba", b"\n"]
    for _ in range(300):
        pieces = [rng.choice(alphabet) for _ in range(rng.randint(1, 20))]
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 3)))]
        text, sent, stopped = _run(pieces, stops)
        full = b"".join(pieces).decode("utf-8", errors="replace")
        assert "".join(sent) == text
        assert stops[0] not in text
        if stopped:
            assert full.startswith(text) and stops[0] in full
        else:
            assert stops[0] not in full


# -- on a live server ------------------------------------------------------------------

N_NEW = 24
PROMPTS = ["你好", "hello", "这个酒店"]


def _ids(tok, prompt: str) -> list[int]:
    return [tok.bos_token_id] + tok.encode(
        f"<|user|>\n{prompt}\n<|assistant|>\n", add_special_tokens=False
    )


def _cut(text: str) -> tuple[str, int]:
    """A stop string taken from inside ``text`` (its first occurrence, not at 0)."""
    for size in (2, 1):
        for p in range(1, len(text) - size + 1):
            s = text[p : p + size]
            if "\ufffd" not in s and not s.isspace() and text.find(s) == p:
                return s, p
    raise AssertionError(f"no stop string to take from {text!r}")


def _sse(lines: list[str]) -> list[dict]:
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("batch", [16, 1], ids=["continuous", "one-at-a-time"])
def test_stop_on_the_openai_endpoint(served_chat, batch):
    model, tok = served_chat.model, served_chat.tokenizer
    cases = []
    for prompt in PROMPTS:
        ids = _ids(tok, prompt)
        x = torch.tensor([ids])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N_NEW
        )
        full = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
        stop, at = _cut(full)
        cases.append((prompt, full, stop, at))
    with live_server(served_chat, chat_batch_size=batch, max_new_tokens=N_NEW) as url:
        info = httpx.get(url).json()
        assert info["chat_batching"].startswith("continuous" if batch > 1 else "off")
        for prompt, full, stop, at in cases:
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": N_NEW,
                "temperature": 0,
            }
            for stops in (stop, ["never-seen", stop]):
                r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stop": stops})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["message"]["content"] == full[:at], (prompt, stops)
                assert choice["finish_reason"] == "stop"
                assert r.json()["usage"]["completion_tokens"] <= N_NEW
            with httpx.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json={**body, "stop": stop, "stream": True},
                timeout=60,
            ) as s:
                chunks = _sse(list(s.iter_lines()))
            contents = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:]]
            assert "".join(contents) == full[:at]
            assert not any(stop in c for c in contents)
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            # without a stop the same request runs to its length, unchanged
            r = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert r.json()["choices"][0]["message"]["content"] == full
        for bad, field in (([], None), (["a"] * 5, "stop"), ("", "stop"), (["x", ""], "stop")):
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stop": bad})
            if field is None:  # an empty list is no stop at all, as OpenAI takes it
                assert r.status_code == 200
                continue
            assert r.status_code == 422 and r.json()["field"] == field, r.text
        assert httpx.get(f"{url}/health").status_code == 200
