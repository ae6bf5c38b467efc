"""``meshtrain serve`` for chat runs HTTP in a forked process and the model in its own
(``serve/split_process.py``): the real command in a subprocess, checked for what the
one-process server does -- greedy answers equal to ``model.generate``, per-request
streaming with stop strings, sampling, metrics, the bounded queue (503 with
Retry-After), 504 and a client that goes away stopping the generation in the model
process, and shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.serve.test_batched_server import _metric, _reference
from tests.serve.test_chat import default_format_ids
from tests.serve.test_loading import _serve_on_a_free_port

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _serve(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    proc, port = _serve_on_a_free_port(model_dir, "--log-level", "warning", *flags)
    return proc, f"http://127.0.0.1:{port}"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM, as a service manager stops it: the HTTP child shuts down, then the model
    process ends as the child did (uvicorn re-raises SIGTERM after its graceful shutdown,
    older versions exit 0)."""
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0].decode()
    for child in children:  # reaped by the model process: gone, not a zombie
        assert not Path(f"/proc/{child}").exists(), f"HTTP process {child} outlived the server"
    return proc.returncode, out


def _sse(text: str) -> list[dict]:
    lines = [x.removeprefix("data: ") for x in text.split("\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_split_server_answers_like_one_process(chat_dir):
    """Six concurrent greedy requests on both routes equal ``model.generate`` alone; a
    stream with a stop string equals its non-streamed answer; sampling answers; metrics
    and ``GET /`` count what the model process did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(chat_dir).eval()
    tok = AutoTokenizer.from_pretrained(chat_dir)
    prompts = ["hello", "good film", "bad", "ok then", "是的", "a longer prompt here"]
    want = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = default_format_ids(chat_dir, p, [])
            want.append(tok.decode(_reference(model, ids, 8 + 2 * i), skip_special_tokens=True))
    proc, url = _serve(chat_dir, "--max-new-tokens", "24")
    try:
        assert len(_children(proc.pid)) == 1, "no HTTP process was forked"

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                seed = [
                    client.post("/", json={"prompt": p, "max_new_tokens": 8 + 2 * i})
                    for i, p in enumerate(prompts[:3])
                ]
                openai = [
                    client.post(
                        "/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": p}],
                            "max_tokens": 8 + 2 * (i + 3),
                            "temperature": 0,
                        },
                    )
                    for i, p in enumerate(prompts[3:])
                ]
                return await asyncio.gather(*seed, *openai)

        rs = asyncio.run(burst())
        assert [r.status_code for r in rs] == [200] * 6
        got = [r.json()["response"] for r in rs[:3]]
        got += [r.json()["choices"][0]["message"]["content"] for r in rs[3:]]
        assert got == want

        stop = want[5][3:5] if len(want[5]) > 5 else None
        body = {
            "messages": [{"role": "user", "content": prompts[5]}],
            "max_tokens": 18,
            "temperature": 0,
            "stop": stop,
        }
        plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        streamed = httpx.post(
            f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        )
        chunks = _sse(streamed.text)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
        assert text == plain["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]

        sampled = httpx.post(
            url, json={"prompt": "hi", "temperature": 0.9, "top_p": 0.8}, timeout=60
        )
        assert sampled.status_code == 200

        info = httpx.get(url, timeout=60).json()
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
    finally:
        code, out = _stop(proc)
    assert code in (0, -signal.SIGTERM), out
    assert info["chat_batching"] == "continuous, up to 16 sequences"
    assert info["answered"] == 9
    assert _metric(metrics, "meshtrain_serve_generated_tokens_total") == info["generated_tokens"]
    steps = _metric(metrics, "meshtrain_serve_batch_size_count", kind="chat")
    assert steps > 0 and _metric(metrics, "meshtrain_serve_batch_size_sum", kind="chat") >= 9
    assert "meshtrain_serve_running_sequences 0.0" in metrics


@pytest.fixture(scope="module")
def endless_dir(chat_dir, tmp_path_factory):
    """The test chat model with room for 8,000 new tokens, all of which it must make
    (``min_new_tokens``): an answer that is not cancelled takes thousands of steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("endless")
    model = AutoModelForCausalLM.from_pretrained(chat_dir)
    model.config.max_position_embeddings = 8192
    model.generation_config.min_new_tokens = 8000
    model.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(chat_dir)
    tok.model_max_length = 8192
    tok.save_pretrained(folder)
    return folder


def _settled(url: str) -> str:
    """/metrics once no sequence runs and none waits (a stopped generation ends at its
    next step; one not stopped runs on to its 8,000 tokens, and the caller sees them)."""
    deadline = time.monotonic() + 300
    while True:
        text = httpx.get(f"{url}/metrics", timeout=60).text
        idle = "meshtrain_serve_running_sequences 0.0" in text
        if idle and 'meshtrain_serve_queue_depth{queue="chat"} 0.0' in text:
            return text
        assert time.monotonic() < deadline, "the generations never ended"
        time.sleep(0.05)


def test_split_server_queue_and_timeout(endless_dir):
    """Two sequences decode and one request waits: of six sent together at least three
    get 503 with Retry-After at once; the accepted ones get 504 after 0.5 s, and the
    model process stops them (far fewer than their 8,000 tokens each were made). The
    server then answers, and ends on SIGTERM. (A request still in the pipe counts as
    waiting, so a burst may see more 503s: docs/serve.md, "The queue".)"""
    proc, url = _serve(
        endless_dir,
        *("--max-new-tokens", "8000", "--chat-batch-size", "2", "--max-queue", "1"),
        *("--timeout", "0.5"),
    )
    try:

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                body = {"prompt": "hi", "max_new_tokens": 8000}
                return await asyncio.gather(*(client.post("/", json=body) for _ in range(6)))

        rs = asyncio.run(burst())
        codes = sorted(r.status_code for r in rs)
        assert codes.count(503) >= 3 and set(codes) <= {503, 504}, codes
        assert all(r.headers["retry-after"] == "1" for r in rs if r.status_code == 503)
        assert all("no answer within" in r.json()["error"] for r in rs if r.status_code == 504)
        made = _metric(_settled(url), "meshtrain_serve_generated_tokens_total")
        assert made < 8000 * codes.count(504), made

        ok = httpx.post(url, json={"prompt": "hi", "max_new_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        code, out = _stop(proc)
    assert code in (0, -signal.SIGTERM), out


@contextlib.contextmanager
def _endless_stream(url: str):
    """A streamed 8,000-token answer that has begun; yields its remaining lines."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while "content" not in next(lines):  # the answer has begun
                pass
            yield lines


def test_split_server_stops_a_stream_whose_client_went_away(endless_dir):
    """A streamed answer of 8,000 tokens whose client closes the connection after the
    first pieces is stopped in the model process: far fewer tokens are made. Batching
    off here (``model.generate`` one at a time, in the model process): the other tests
    cover the continuous batcher."""
    proc, url = _serve(endless_dir, "--max-new-tokens", "8000", "--chat-batch-size", "1")
    try:
        with _endless_stream(url):
            pass
        # the stream is closed: the client is gone
        made = _metric(_settled(url), "meshtrain_serve_generated_tokens_total")
        assert 0 < made < 8000, made
    finally:
        code, out = _stop(proc)
    assert code in (0, -signal.SIGTERM), out


def test_model_process_ends_when_the_http_process_dies(endless_dir):
    """The HTTP child killed (SIGKILL) while the continuous batcher decodes an 8,000-token
    answer: the batcher's thread, which reads the pipe between its steps, sees its end,
    drops the running sequence and stops, and the model process exits as its child did
    (it re-raises the signal; it used to fail with a traceback trying to set a SIGKILL
    handler, status 1)."""
    proc, url = _serve(endless_dir, "--max-new-tokens", "8000", "--chat-batch-size", "4")
    try:
        (child,) = _children(proc.pid)
        with _endless_stream(url) as lines:
            os.kill(child, signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):  # the connection dies with its process
                for _ in lines:
                    pass
        code = proc.wait(timeout=60)  # a hang here would be the model process not ending
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert code == -signal.SIGKILL, proc.stdout.read().decode()[-3000:]


def test_no_http_process_keeps_one_process(chat_dir):
    """``--no-http-process``: no child process, and chat answers as before."""
    proc, url = _serve(chat_dir, "--max-new-tokens", "4", "--no-http-process")
    try:
        assert _children(proc.pid) == []
        r = httpx.post(url, json={"prompt": "hi"}, timeout=60)
        assert r.status_code == 200 and "response" in r.json()
    finally:
        code, out = _stop(proc)
    assert code in (0, -signal.SIGTERM), out
