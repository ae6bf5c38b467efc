"""Every bad request gets its 4xx with a message naming the field, never a 5xx, and the
server stays healthy afterwards (real uvicorn server, real HTTP client)."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import live_server

LIMIT = 4096  # max_body_bytes of these servers

CLASSIFY_CASES = [
    # (name, raw body or JSON, headers, status, field)
    ("invalid JSON", b'{"text": "a",', {"content-type": "application/json"}, 400, "body"),
    ("JSON without content-type", b'{"text": "a"}', {"content-type": "text/plain"}, 415, "body"),
    ("not an object", [1, 2], None, 422, "body"),
    ("empty body", b"", {"content-type": "application/json"}, 422, "body"),
    ("missing text", {}, None, 422, "text"),
    ("text is a number", {"text": 5}, None, 422, "text"),
    ("a list item is a number", {"text": ["a", 5]}, None, 422, "text"),
    ("empty text", {"text": ""}, None, 422, "text"),
    ("blank text", {"text": "   "}, None, 422, "text"),
    ("empty list", {"text": []}, None, 422, "text"),
    ("an empty item", {"text": ["ok", ""]}, None, 422, "text[1]"),
    ("unknown field", {"text": "a", "labels": 3}, None, 422, "labels"),
    ("too many texts", {"text": ["a"] * 9}, None, 422, "text"),
    ("body over the limit", {"text": "长" * LIMIT}, None, 413, "body"),
]

CHAT_CASES = [
    ("missing prompt", {"history": []}, 422, "prompt"),
    ("prompt is a number", {"prompt": 5}, 422, "prompt"),
    ("empty prompt", {"prompt": ""}, 422, "prompt"),
    ("history not a list", {"prompt": "a", "history": "x"}, 422, "history"),
    ("history round of one", {"prompt": "a", "history": [["q"]]}, 422, "history"),
    ("history round of three", {"prompt": "a", "history": [["q", "a", "b"]]}, 422, "history[0]"),
    ("history item not a string", {"prompt": "a", "history": [["q", 1]]}, 422, "history.0.1"),
    ("max_new_tokens zero", {"prompt": "a", "max_new_tokens": 0}, 422, "max_new_tokens"),
    ("max_new_tokens a string", {"prompt": "a", "max_new_tokens": "5"}, 422, "max_new_tokens"),
    ("max_new_tokens over limit", {"prompt": "a", "max_new_tokens": 9}, 422, "max_new_tokens"),
    ("max_length too small", {"prompt": "a", "max_length": 2}, 422, "max_length"),
    ("negative temperature", {"prompt": "a", "temperature": -1}, 422, "temperature"),
    ("top_p over 1", {"prompt": "a", "top_p": 2}, 422, "top_p"),
    ("do_sample a string", {"prompt": "a", "do_sample": "yes"}, 422, "do_sample"),
    ("prompt over the context", {"prompt": "hello " * 400}, 422, "prompt"),
    ("unknown field", {"prompt": "a", "promt": "a"}, 422, "promt"),
]

OPENAI_CASES = [
    ("missing messages", {"model": "x"}, 422, "messages"),
    ("no messages", {"messages": []}, 422, "messages"),
    ("bad role", {"messages": [{"role": "bot", "content": "a"}]}, 422, "messages.0.role"),
    ("content a number", {"messages": [{"role": "user", "content": 1}]}, 422, "messages.0.content"),
    ("last is assistant", {"messages": [{"role": "assistant", "content": "a"}]}, 422, "messages"),
    ("n is 2", {"messages": [{"role": "user", "content": "a"}], "n": 2}, 422, "n"),
    (
        "stream a string",
        {"messages": [{"role": "user", "content": "a"}], "stream": "y"},
        422,
        "stream",
    ),
]


def _post(url: str, path: str, body, headers=None) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers=headers, timeout=30)
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def _check(r: httpx.Response, status: int, field: str, name: str) -> None:
    assert r.status_code == status, (name, r.status_code, r.text)
    body = r.json()
    assert body["status"] == status and field in body["error"], (name, body)


@pytest.fixture(scope="module")
def classify_url(served_classifier):
    with live_server(served_classifier, max_body_bytes=LIMIT, max_texts=8) as url:
        yield url


@pytest.fixture(scope="module")
def chat_url(served_chat):
    with live_server(served_chat, max_body_bytes=LIMIT, max_new_tokens=8) as url:
        yield url


def test_classify_bad_inputs(classify_url):
    for name, body, headers, status, field in CLASSIFY_CASES:
        _check(_post(classify_url, "/classify", body, headers), status, field, name)
    # a chunked body (no Content-Length) over the limit is cut off at the limit
    chunks = iter([b'{"text": "', b"x" * LIMIT, b'"}'])
    r = httpx.post(
        classify_url + "/classify",
        content=chunks,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    _check(r, 413, "body", "chunked body over the limit")
    _check(_post(classify_url, "/", {"prompt": "a"}), 404, "POST /classify", "chat on a classifier")
    assert httpx.get(classify_url + "/classify", timeout=30).status_code == 405
    assert httpx.get(classify_url + "/nope", timeout=30).status_code == 404
    assert httpx.get(classify_url + "/health", timeout=30).json()["status"] == "ok"
    assert (
        httpx.post(classify_url + "/classify", json={"text": "ok"}, timeout=30).status_code == 200
    )


def test_chat_bad_inputs(chat_url):
    for name, body, status, field in CHAT_CASES:
        _check(_post(chat_url, "/", body), status, field, name)
    for name, body, status, field in OPENAI_CASES:
        _check(_post(chat_url, "/v1/chat/completions", body), status, field, name)
    _check(_post(chat_url, "/classify", {"text": "a"}), 404, "POST /", "classify on a chat model")
    r = _post(chat_url, "/", b"prompt=a", {"content-type": "application/x-www-form-urlencoded"})
    _check(r, 400, "body", "form-encoded body (curl -d without -H)")
    assert httpx.get(chat_url + "/health", timeout=30).json()["status"] == "ok"
    ok = _post(chat_url, "/", {"prompt": "a", "history": [["q", "a"]], "max_new_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["history"]) == 2
