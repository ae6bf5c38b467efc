"""Continuous batching on a live server: concurrent requests on both chat routes (plain
and streamed, greedy and sampled) share decoding steps and each greedy answer equals
``model.generate`` on its prompt alone; the bounded queue still answers 503; a
generation_config the loop does not implement falls back to one sequence at a time; and
``GET /metrics`` shows requests by status, latency, queue depth, batch size and tokens.

Greedy answers are compared exactly in fp32 (test_continuous.py states the caveat).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import torch

from tests.serve.conftest import live_server
from tests.serve.test_chat import default_format_ids

PROMPTS = ["你好", "hello how are you", "what is your name", "讲个笑话", "天气", "good"]


def _reference(model, ids: list[int], n: int) -> str:
    return model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
    )[0, len(ids) :].tolist()


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = (
        rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? (\S+)$" if want else rf"^{name} (\S+)$"
    )
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.groups()[-1])
    return 0.0


def test_concurrent_requests_share_steps_and_match_generate(chat_dir, served_chat):
    tok, model = served_chat.tokenizer, served_chat.model
    n_new = [6, 20, 12, 3, 16, 9]
    expected = []
    for p, n in zip(PROMPTS, n_new, strict=True):
        expected.append(
            tok.decode(
                _reference(model, default_format_ids(chat_dir, p, []), n), skip_special_tokens=True
            )
        )

    async def burst(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def seed(i: int):
                r = await client.post("/", json={"prompt": PROMPTS[i], "max_new_tokens": n_new[i]})
                return r.status_code, r.json()["response"]

            async def openai(i: int, stream: bool):
                body = {
                    "messages": [{"role": "user", "content": PROMPTS[i]}],
                    "max_tokens": n_new[i],
                    "temperature": 0,
                    "stream": stream,
                }
                if not stream:
                    r = await client.post("/v1/chat/completions", json=body)
                    return r.status_code, r.json()["choices"][0]["message"]["content"]
                text = ""
                async with client.stream("POST", "/v1/chat/completions", json=body) as s:
                    async for line in s.aiter_lines():
                        if line.startswith("data: {"):
                            delta = json.loads(line[6:])["choices"][0]["delta"]
                            text += delta.get("content", "")
                return s.status_code, text

            async def sampled():
                body = {"prompt": "hi", "max_new_tokens": 20, "temperature": 0.9, "top_p": 0.8}
                r = await client.post("/", json=body)
                return r.status_code, r.json()["response"]

            jobs = [seed(0), seed(1), openai(2, False), openai(3, True), openai(4, True), seed(5)]
            jobs += [sampled(), sampled()]
            out = await asyncio.gather(*jobs)
            metrics = (await client.get("/metrics")).text
            info = (await client.get("/")).json()
            return out, metrics, info

    # each step sleeps 5 ms, so requests sent together are still running when the others join
    slow = model.register_forward_pre_hook(lambda *_: time.sleep(0.005))
    try:
        with live_server(served_chat, max_new_tokens=32, chat_batch_size=8) as url:
            out, metrics, info = asyncio.run(burst(url))
    finally:
        slow.remove()
    assert [code for code, _ in out] == [200] * 8
    assert [text for _, text in out[:6]] == expected
    assert info["chat_batching"] == "continuous, up to 8 sequences"
    assert info["answered"] == 8
    # the steps were shared: more sequences decoded than steps taken
    steps = _metric(metrics, "meshtrain_serve_batch_size_count", kind="chat")
    seqs = _metric(metrics, "meshtrain_serve_batch_size_sum", kind="chat")
    assert steps > 0 and seqs / steps > 1.5, (steps, seqs)
    assert _metric(metrics, "meshtrain_serve_requests_total", route="/", status="200") == 5
    assert (
        _metric(
            metrics, "meshtrain_serve_requests_total", route="/v1/chat/completions", status="200"
        )
        == 3
    )
    assert _metric(metrics, "meshtrain_serve_request_duration_seconds_count", route="/") == 5
    assert _metric(metrics, "meshtrain_serve_generated_tokens_total") == info["generated_tokens"]
    assert info["generated_tokens"] >= sum(len(t) > 0 for _, t in out)
    assert 'meshtrain_serve_queue_depth{queue="chat"} 0.0' in metrics
    assert "meshtrain_serve_running_sequences 0.0" in metrics
    assert _metric(metrics, "meshtrain_serve_tokens_per_second") > 0


def test_full_queue_is_503_under_batching(chat_dir):
    """At most two sequences decode and one waits: of six requests sent together, at least
    three are answered 503 with Retry-After at once, the others are answered, and the
    server keeps answering.

    Until ``gate`` opens, each decoding step sleeps 10 ms and each answer needs 240 steps,
    so no answer can finish within 2.4 s of its start; the gate opens once three requests
    have been answered (the 503s), or after 30 s. So nothing leaves while the six arrive
    (a slow client once let a fourth in after a short answer ended). Requests arriving
    within one step beyond the one queue place get 503 even when the batch has room
    (docs/serve.md, "The queue"), so a fast burst may see more than three."""
    from meshtrain.serve.model_loading import load

    served = load(chat_dir)
    served.model.generation_config.min_new_tokens = 240  # no early EOS
    armed, gate = threading.Event(), threading.Event()

    def slow_until_gate(*_) -> None:  # armed after start-up (build_app runs a probe forward)
        if armed.is_set() and not gate.is_set():
            time.sleep(0.01)

    slow = served.model.register_forward_pre_hook(slow_until_gate)

    async def burst(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"prompt": "hi", "max_new_tokens": 240}
            armed.set()
            tasks = [asyncio.create_task(client.post("/", json=body)) for _ in range(6)]
            deadline = time.monotonic() + 30
            while sum(t.done() for t in tasks) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            gate.set()
            rs = await asyncio.gather(*tasks)
            metrics = (await client.get("/metrics")).text
            return rs, metrics

    try:
        with live_server(served, max_queue=1, chat_batch_size=2, max_new_tokens=240) as url:
            rs, metrics = asyncio.run(burst(url))
            ok = httpx.post(url, json={"prompt": "hi", "max_new_tokens": 2}, timeout=60)
    finally:
        gate.set()
        slow.remove()
    codes = sorted(r.status_code for r in rs)
    # >= 1 answered: a burst can fill the one queue place before the idle worker wakes
    assert codes.count(503) >= 3 and codes.count(200) >= 1 and set(codes) <= {200, 503}, codes
    assert all(r.headers["retry-after"] == "1" for r in rs if r.status_code == 503)
    assert ok.status_code == 200
    assert _metric(
        metrics, "meshtrain_serve_requests_total", route="/", status="503"
    ) == codes.count(503)


def test_unbatchable_generation_config_runs_one_at_a_time(chat_dir):
    """repetition_penalty is not implemented by the batched loop: the server says so and
    answers with model.generate (which applies it), one request at a time."""
    from meshtrain.serve.model_loading import load

    served = load(chat_dir)
    served.model.generation_config.repetition_penalty = 1.3
    ids = default_format_ids(chat_dir, "hello", [])
    want = served.tokenizer.decode(_reference(served.model, ids, 12), skip_special_tokens=True)
    with live_server(served, max_new_tokens=12) as url:
        r = httpx.post(url, json={"prompt": "hello"}, timeout=60)
        info = httpx.get(url).json()
    assert info["chat_batching"].startswith("off (generation_config.repetition_penalty=1.3")
    assert r.json()["response"] == want


def test_metrics_on_a_classifier(served_classifier):
    with live_server(served_classifier) as url:
        httpx.post(f"{url}/classify", json={"text": ["good", "bad"]}, timeout=60)
        httpx.post(f"{url}/classify", json={"txt": "x"}, timeout=60)
        httpx.get(f"{url}/no/such/path", timeout=60)
        r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert _metric(text, "meshtrain_serve_requests_total", route="/classify", status="200") == 1
    assert _metric(text, "meshtrain_serve_requests_total", route="/classify", status="422") == 1
    assert _metric(text, "meshtrain_serve_requests_total", route="other", status="404") == 1
    assert _metric(text, "meshtrain_serve_batch_size_sum", kind="classify") == 2
    assert 'meshtrain_serve_queue_depth{queue="classify"} 0.0' in text


def test_bad_settings_are_refused_by_name(served_chat):
    from meshtrain.errors import ServeError
    from meshtrain.serve.app import ServeSettings, build_app

    with pytest.raises(ServeError, match="context_overflow 'drop' is not a policy"):
        build_app(served_chat, ServeSettings(context_overflow="drop"))
    with pytest.raises(ServeError, match="chat_batch_size 0 must be >= 1"):
        build_app(served_chat, ServeSettings(chat_batch_size=0))
    with pytest.raises(ServeError, match="prefill_chunk 0 must be >= 1"):
        build_app(served_chat, ServeSettings(prefill_chunk=0))
    with pytest.raises(ServeError, match="kv_blocks -3 must be >= 1"):
        build_app(served_chat, ServeSettings(kv_blocks=-3))
