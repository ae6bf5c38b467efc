"""Chat on a real uvicorn server: the seeds' POST / shape, OpenAI's endpoint with streaming,
and a generation queue that answers 503/504 instead of hanging.

Greedy answers are compared exactly (same weights, same ids, same fp32 kernels: the
server's ``model.generate`` and the reference's pick the same argmax at every step).
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.serve.conftest import live_server

N_NEW = 12


def reference(folder, ids: list[int], n: int = N_NEW) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def default_format_ids(folder, prompt: str, history: list[list[str]]) -> list[int]:
    """The documented turn format, written out here independently of the server."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = [tok.bos_token_id]
    for q, a in history:
        ids += tok.encode(f"<|user|>\n{q}\n<|assistant|>\n{a}\n", add_special_tokens=False)
    return ids + tok.encode(f"<|user|>\n{prompt}\n<|assistant|>\n", add_special_tokens=False)


def test_seed_shape_history_and_greedy(chat_dir, served_chat):
    with live_server(served_chat, max_new_tokens=N_NEW) as url:
        r1 = httpx.post(url, json={"prompt": "你好", "history": []}, timeout=60)
        assert r1.status_code == 200, r1.text
        first = r1.json()
        r2 = httpx.post(url, json={"prompt": "hello", "history": first["history"]}, timeout=60)
        second = r2.json()
        info = httpx.get(url).json()
    assert set(first) == {"response", "history", "status", "time"}
    assert first["status"] == 200 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", first["time"])
    assert first["history"] == [["你好", first["response"]]]
    assert second["history"] == [["你好", first["response"]], ["hello", second["response"]]]
    assert first["response"] == reference(chat_dir, default_format_ids(chat_dir, "你好", []))
    ids2 = default_format_ids(chat_dir, "hello", first["history"])
    assert second["response"] == reference(chat_dir, ids2)
    assert info["task"] == "chat" and info["chat_format"] == "meshtrain" and info["answered"] == 2


def _sse(lines: list[str]) -> list:
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_openai_endpoint_with_template_and_streaming(chat_template_dir):
    from transformers import AutoTokenizer

    from meshtrain.serve.model_loading import load

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "你好"},
    ]
    tok = AutoTokenizer.from_pretrained(chat_template_dir)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    expected = reference(chat_template_dir, ids)
    body = {
        "model": "x",
        "messages": messages,
        "max_tokens": N_NEW,
        "temperature": 0,
        "presence_penalty": 0,
    }
    with live_server(load(chat_template_dir), model_name="tiny") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            chunks = _sse(list(s.iter_lines()))
    out = r.json()
    assert r.status_code == 200 and out["object"] == "chat.completion" and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected}
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["total_tokens"] == len(ids) + out["usage"]["completion_tokens"]
    assert choice["finish_reason"] == (
        "length" if out["usage"]["completion_tokens"] == N_NEW else "stop"
    )
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert streamed == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_full_queue_is_503_and_slow_request_is_504(chat_dir):
    """One worker, a queue of one: while the worker is held inside a generation and one
    request waits, every further request gets 503 with Retry-After at once; released, the
    two accepted requests answer 200. A timeout answers 504 and stops the generation,
    after which the server answers normally.

    The worker is held by a gate in the model's forward, not by the model being slow, so
    the test proves the queue's behaviour on a machine of any speed or load."""
    from meshtrain.serve.model_loading import load

    served = load(chat_dir)
    req = {"prompt": "hi", "max_new_tokens": 4}
    started, release = threading.Event(), threading.Event()

    def gate(*_):
        if not threading.current_thread().name.startswith("meshtrain-"):
            return  # only the generation worker's thread is held (not a start-up probe)
        started.set()
        if not release.wait(120):
            raise RuntimeError("the test never released the worker")

    hook = served.model.register_forward_pre_hook(gate)
    try:
        with (
            live_server(served, max_queue=1, max_new_tokens=4, retry_after_s=3) as url,
            ThreadPoolExecutor(2) as pool,
        ):
            first = pool.submit(httpx.post, url, json=req, timeout=120)
            assert started.wait(60), "the worker never started the first request"
            second = pool.submit(httpx.post, url, json=req, timeout=120)
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/health").json()["waiting"] < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.01)
            busy = [httpx.post(url, json=req, timeout=60) for _ in range(4)]
            release.set()
            accepted = [first.result().status_code, second.result().status_code]
    finally:
        release.set()
        hook.remove()
    assert accepted == [200, 200], accepted
    assert [r.status_code for r in busy] == [503] * 4
    assert all(r.headers["retry-after"] == "3" for r in busy)
    assert "busy" in busy[0].json()["error"]

    served.model.generation_config.min_new_tokens = 60
    # each decoding step sleeps 10 ms, so 60 tokens take >= 0.6 s whatever the machine: on
    # a quiet one the tiny model alone made 60 tokens inside the 0.05 s timeout (got 200)
    slow = served.model.register_forward_pre_hook(lambda *_: time.sleep(0.01))
    with live_server(served, timeout_s=0.05, max_new_tokens=60) as url:
        late = httpx.post(url, json={"prompt": "hi"}, timeout=60)
        assert late.status_code == 504 and "no answer within" in late.json()["error"]
        slow.remove()
        served.model.generation_config.min_new_tokens = None
        ok = httpx.post(url, json={"prompt": "hi", "max_new_tokens": 1}, timeout=60)
        # the request may itself hit 0.05 s on a loaded machine; the server must be healthy
        assert ok.status_code in (200, 504)
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


@pytest.mark.parametrize("fmt", ["chatglm"])
def test_chatglm_turn_format(chat_dir, fmt):
    """--chat-format chatglm builds the seeds' [Round i]/问/答 prompt."""
    from transformers import AutoTokenizer

    from meshtrain.serve.model_loading import load

    tok = AutoTokenizer.from_pretrained(chat_dir)
    history = [["你好", "你好!"]]
    text = ["[Round 0]\n问:你好\n答:你好!\n", "[Round 1]\n问:天气\n答:"]
    ids = [tok.bos_token_id] + [i for t in text for i in tok.encode(t, add_special_tokens=False)]
    with live_server(load(chat_dir), chat_format=fmt, max_new_tokens=N_NEW) as url:
        r = httpx.post(url, json={"prompt": "天气", "history": history}, timeout=60)
    assert r.json()["response"] == reference(chat_dir, ids)
