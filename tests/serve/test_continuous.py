"""Continuous batching (``serve/continuous.py``): greedy answers under batching equal
``model.generate`` on each prompt alone, sequences join and leave mid-batch, prompts are
prefilled in chunks inside the others' decoding steps, and the paged cache
(``serve/paged_kv.py``) holds blocks in proportion to the live tokens, gives them back
when a sequence ends, and admits a request only when its blocks are free.

Exactness: compared token for token in fp32 on CPU. Batched matrix products, chunked
prefills and attention over gathered slots may sum in another order than batch 1, so
logits can differ in the last bits; no argmax changed on these 50 prompts. In bf16/fp16 a near-tie can swap (the
caveat documented in docs/serve.md), so these checks run in fp32 only.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tests.serve import models


def _prompts(tok, n: int = 50) -> list[list[int]]:
    """``n`` prompts of 1 to ~120 tokens from real reviews, shuffled lengths."""
    rng = random.Random(0)
    texts = models.reviews(400)
    out = []
    for i in range(n):
        pieces = rng.randint(1, 4)
        text = " ".join(texts[(7 * i + j) % len(texts)] for j in range(pieces))
        ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
        out.append(ids[: rng.randint(1, 120)])
    return out


def test_greedy_under_batching_equals_generate_alone(served_chat):
    from meshtrain.serve.chat import Chat
    from meshtrain.serve.continuous import ContinuousBatcher
    from meshtrain.serve.paged_model import blocker

    model, tok = served_chat.model, served_chat.tokenizer
    assert served_chat.dtype == torch.float32
    chat = Chat(served_chat)
    assert blocker(model) is None
    prompts = _prompts(tok)
    rng = random.Random(1)
    max_new = [rng.randint(1, 24) for _ in prompts]  # rows leave at different steps
    expected = []
    for ids, n in zip(prompts, max_new, strict=True):
        x = torch.tensor([ids])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n
        )
        expected.append(out[0, len(ids) :].tolist())
    steps: list[int] = []
    worker = ContinuousBatcher(chat, max_batch=8, max_queue=64, on_step=steps.append)

    async def run_all():
        jobs = []
        for ids, n in zip(prompts, max_new, strict=True):
            kwargs = chat.generate_kwargs(len(ids), n)
            jobs.append(worker.submit(ids, kwargs))
            await asyncio.sleep(0.002 * rng.random())  # arrivals spread over the steps
        return await asyncio.gather(*(j.future for j in jobs))

    try:
        answers = asyncio.run(run_all())
    finally:
        worker.close()
    for i, (answer, want) in enumerate(zip(answers, expected, strict=True)):
        assert answer.token_ids == want, i
        assert answer.text == tok.decode(want, skip_special_tokens=True), i
        assert answer.finish_reason == ("stop" if want[-1] in chat.eos_ids else "length")
    assert max(steps) > 1, "the prompts never shared a decoding step"
    assert worker.prefills < len(prompts), "no two prompts were prefilled together"
    assert worker.done == len(prompts)


def test_paged_cache_holds_live_tokens_frees_blocks_and_admits_by_blocks(served_chat):
    """Small blocks (4 tokens), a pool of 24 blocks (room for two or three of these
    requests) and 7-token prefill chunks (every prompt is cut): at every step the blocks
    held are exactly ceil(cached tokens / 4) per live sequence, the reserved blocks never
    exceed the pool, requests wait for blocks instead of failing, and every greedy answer
    still equals ``model.generate`` alone."""
    from meshtrain.errors import ServeError
    from meshtrain.serve.chat import Chat
    from meshtrain.serve.continuous import ContinuousBatcher

    model, tok = served_chat.model, served_chat.tokenizer
    chat = Chat(served_chat)
    prompts = [p for p in _prompts(tok, 40) if 8 <= len(p) <= 60][:12]
    max_new = [6 + i % 5 for i in range(len(prompts))]
    expected = []
    for ids, n in zip(prompts, max_new, strict=True):
        x = torch.tensor([ids])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n
        )
        expected.append(out[0, len(ids) :].tolist())
    seen = {"running": [], "waiting": [], "bad": []}
    worker = None

    def check(batch: int) -> None:  # on the worker thread, after each forward
        live = worker._seqs
        held = sum(-(-s.paged.length // 4) for s in live)
        if worker.pool.in_use != held or sum(s.need for s in live) > 24:
            seen["bad"].append((worker.pool.in_use, held, [s.need for s in live]))
        seen["running"].append(len(live))
        seen["waiting"].append(worker.waiting)

    worker = ContinuousBatcher(
        chat, max_batch=8, max_queue=64, on_step=check, prefill_chunk=7, block_size=4, kv_blocks=24
    )

    async def run_all():
        jobs = [
            worker.submit(ids, chat.generate_kwargs(len(ids), n))
            for ids, n in zip(prompts, max_new, strict=True)
        ]
        answers = await asyncio.gather(*(j.future for j in jobs))
        too_long = worker.submit(list(range(1, 100)), chat.generate_kwargs(99, 8))
        with pytest.raises(ServeError, match="key/value blocks"):
            await too_long.future
        return answers

    try:
        answers = asyncio.run(run_all())
    finally:
        worker.close()
    assert [a.token_ids for a in answers] == expected
    assert not seen["bad"], seen["bad"][:3]
    assert max(seen["running"]) >= 2, "no two requests ever shared a step"
    assert max(seen["waiting"]) > 0, "no request ever waited for blocks"
    assert worker.pool.in_use == 0 and worker.pool.capacity <= 24
