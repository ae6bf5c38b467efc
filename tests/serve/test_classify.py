"""POST /classify on a real uvicorn server: the offline pipeline's answers, batched or not.

Tolerances (``tests/tolerance.py``): a batched text is padded to the batch's longest text
with the mask set, so its logits differ from the text alone only by fp32 summation order:
scores (probabilities, at most 1) within ``evaluation()``. The served score against
``transformers.pipeline``: both fp32 softmax of the same logits, the pipeline's in numpy,
ours in torch (two implementations of exp and the sum, each within one evaluation):
``2 evaluation()`` (measured ~1e-7 apart).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.serve.conftest import live_server
from tests.serve.models import CONTEXT, LABELS, reviews
from tests.tolerance import evaluation

TEXTS = ["我觉得不错!", "房间太小，服务很差", "good", "还行吧"] + reviews(24)[::3]


def test_matches_pipeline_and_batching(classifier_dir, served_classifier):
    from transformers import pipeline

    pipe = pipeline("text-classification", model=str(classifier_dir), device="cpu")
    texts = [t[:40] for t in TEXTS]  # within the context: the pipeline does not truncate
    expected = [pipe(t)[0] for t in texts]
    assert {e["label"] for e in expected} <= set(LABELS.values())

    async def fire(url: str, batch_size: int) -> tuple[list[dict], dict]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            rs = await asyncio.gather(*(client.post("/classify", json={"text": t}) for t in texts))
            info = (await client.get("/")).json()
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json() for r in rs], info

    with live_server(served_classifier, max_batch_size=1) as url:
        alone, info1 = asyncio.run(fire(url, 1))
        one = httpx.post(f"{url}/classify", json={"text": texts}, timeout=60).json()  # a list
    # a batch waits up to 1 s to fill: the 12 concurrent requests must meet in one even
    # when a loaded machine spreads their arrival over more than a few milliseconds
    with live_server(served_classifier, max_batch_size=8, max_wait_ms=1000) as url:
        batched, info8 = asyncio.run(fire(url, 8))
        health = httpx.get(f"{url}/health", timeout=60).json()

    assert info1["batches"] == len(texts)  # batching off: one forward per text
    assert info8["batched_texts"] == len(texts) and info8["batches"] < len(texts)
    assert info8["labels"] == {str(k): v for k, v in LABELS.items()}
    assert health == {"status": "ok", "task": "text-classification", "waiting": 0}
    for e, a, b, c in zip(expected, alone, batched, one, strict=True):
        assert a["label"] == b["label"] == c["label"] == e["label"]
        assert a["score"] == pytest.approx(e["score"], abs=2 * evaluation())
        assert b["score"] == pytest.approx(a["score"], abs=evaluation())
        assert c["score"] == pytest.approx(a["score"], abs=evaluation())
        assert a["truncated"] is b["truncated"] is False


def test_long_text_is_truncated_with_a_note(classifier_dir, served_classifier):
    from transformers import pipeline

    long_text = "".join(reviews(40))  # hundreds of tokens; the context is CONTEXT
    pipe = pipeline("text-classification", model=str(classifier_dir), device="cpu")
    expected = pipe(long_text, truncation=True, max_length=CONTEXT)[0]
    with live_server(served_classifier) as url:
        r = httpx.post(f"{url}/classify", json={"text": [long_text, "还行吧"]}, timeout=60)
    assert r.status_code == 200
    cut, short = r.json()
    assert cut["truncated"] is True and short["truncated"] is False
    assert cut["label"] == expected["label"]
    assert cut["score"] == pytest.approx(expected["score"], abs=2 * evaluation())
