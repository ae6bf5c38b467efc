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
    from meshtrain.serve.continuous import ContinuousBatcher, blocker

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
