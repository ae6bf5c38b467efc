"""Conversations that outgrow the context: the oldest history rounds are dropped until the
prompt fits with room to answer (the default), or the request gets 422 (``"error"``).

The tiny model's context is cut to 64 tokens (``ServedModel.context_length``), so a client
that sends back every ``history`` it receives outgrows it within two turns. Each turn is
checked against a reference computed here independently of the server: the fewest rounds
to drop so that ``len(ids) + reserve <= context`` (``reserve = min(max_new_tokens,
context // 2)``) with the documented turn format, and the greedy answer of
``model.generate`` on what remains (exact: same fp32 weights and ids, batch 1 vs the
server's batch; see test_continuous.py for the summation-order caveat).
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch

from tests.serve.conftest import live_server

CONTEXT, NEW = 64, 24


@pytest.fixture(scope="module")
def reference_model(chat_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(chat_dir).eval(), AutoTokenizer.from_pretrained(
        chat_dir
    )


def format_ids(tok, prompt: str, history: list[list[str]]) -> list[int]:
    """The documented turn format (as test_chat.default_format_ids), tokenizer preloaded."""
    ids = [tok.bos_token_id]
    for q, a in history:
        ids += tok.encode(f"<|user|>\n{q}\n<|assistant|>\n{a}\n", add_special_tokens=False)
    return ids + tok.encode(f"<|user|>\n{prompt}\n<|assistant|>\n", add_special_tokens=False)


def expected_turn(reference_model, prompt, history):
    """(dropped, response) the documented policy gives for this turn."""
    model, tok = reference_model
    reserve = min(NEW, CONTEXT // 2)
    dropped = 0
    ids = format_ids(tok, prompt, history)
    while len(ids) + reserve > CONTEXT and dropped < len(history):
        dropped += 1
        ids = format_ids(tok, prompt, history[dropped:])
    assert len(ids) < CONTEXT, "the test's prompts are short enough to fit alone"
    x = torch.tensor([ids])
    n = min(NEW, CONTEXT - len(ids))
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return dropped, tok.decode(out[0, len(ids) :], skip_special_tokens=True)


@pytest.mark.parametrize("turns", [2, 5, 50])
def test_conversation_keeps_going(chat_dir, served_chat, reference_model, turns):
    small = dataclasses.replace(served_chat, context_length=CONTEXT)
    history: list[list[str]] = []
    dropped_seen = []
    with live_server(small, max_new_tokens=NEW) as url:
        for t in range(turns):
            prompt = ["你好", "hello how are you", "what is your name", "讲个笑话"][t % 4]
            r = httpx.post(url, json={"prompt": prompt, "history": history}, timeout=60)
            assert r.status_code == 200, (t, r.text)
            body = r.json()
            want_dropped, want_response = expected_turn(reference_model, prompt, history)
            assert body["response"] == want_response, t
            assert body.get("dropped_rounds", 0) == want_dropped, t
            assert r.headers["x-dropped-rounds"] == str(want_dropped)
            assert ("dropped_rounds" in body) == (want_dropped > 0)
            # the returned history is the request's history plus this round, never trimmed
            assert body["history"] == history + [[prompt, body["response"]]]
            history = body["history"]
            dropped_seen.append(want_dropped)
    assert len(history) == turns
    assert dropped_seen[-1] > 0, "the conversation never outgrew the context"


def test_error_policy_answers_422_and_openai_reports_drops(served_chat):
    small = dataclasses.replace(served_chat, context_length=CONTEXT)
    long_history = [["hello how are you " * 3, "what is your name " * 3]] * 4
    with live_server(small, max_new_tokens=NEW, context_overflow="error") as url:
        r = httpx.post(url, json={"prompt": "hi", "history": long_history}, timeout=60)
    assert r.status_code == 422 and r.json()["field"] == "prompt"
    assert "context is 64 tokens" in r.json()["error"]

    messages = []
    for q, a in long_history:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": "hi"})
    body = {"messages": messages, "max_tokens": 8}
    with live_server(small, max_new_tokens=NEW) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            lines = list(s.iter_lines())
            header = s.headers["x-dropped-rounds"]
    out = r.json()
    assert r.status_code == 200 and out["dropped_rounds"] == int(r.headers["x-dropped-rounds"])
    assert 1 <= out["dropped_rounds"] <= len(long_history)
    assert out["usage"]["prompt_tokens"] + min(8, CONTEXT // 2) <= CONTEXT
    import json

    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert chunks[-1]["dropped_rounds"] == out["dropped_rounds"] == int(header)
