"""A sharded ZeRO-3 checkpoint (2 ranks, gloo) serves with no conversion step, and gives
the same answers as its consolidated export.

Both paths read the same fp32 masters from the same rank files, so the loaded weights
are compared for exact equality with the weights the engine gathered after training,
and the two servers' answers: labels and greedy text exactly, scores within
``evaluation()`` (``tests/tolerance.py``: the same fp32 weights in differently allocated
tensors may take CPU kernels that sum in another order: 1.2e-7 apart was seen). Batching is off, so each text is computed alone.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.harness import run_ranks
from tests.serve import models
from tests.serve.conftest import live_server
from tests.serve.ranks import train_zero3_and_save
from tests.tolerance import evaluation


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3")
    bert_tok, bpe_tok = models.bert_tokenizer(), models.bpe_tokenizer()
    cfgs = (models.bert_config(bert_tok).to_dict(), models.llama_config(bpe_tok).to_dict())
    states = run_ranks(train_zero3_and_save, 2, str(root), *cfgs)[0]
    # the tokenizer sits beside the checkpoints, in the save_dir, as a training script saves it
    bert_tok.save_pretrained(root / "classifier")
    bpe_tok.save_pretrained(root / "chat")
    return root, states


def _same_weights(model: torch.nn.Module, expected: dict) -> None:
    got = model.state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def _answers(url: str, task: str) -> list:
    async def run() -> list:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            if task == "classifier":
                texts = ["我觉得不错!", "太差了", "good", "还行吧"]
                rs = await asyncio.gather(
                    *(client.post("/classify", json={"text": t}) for t in texts)
                )
            else:
                rs = [await client.post("/", json={"prompt": p}) for p in ("你好", "hello")]
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["response"] if task == "chat" else r.json() for r in rs]

    return asyncio.run(run())


@pytest.mark.parametrize("task", ["classifier", "chat"])
def test_sharded_checkpoint_serves_like_its_export(trained, task, tmp_path):
    from meshtrain.checkpoint import consolidate
    from meshtrain.serve.model_loading import load

    root, states = trained
    save_dir = root / task
    first, last = states[task]
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the tags differ
    sharded = load(save_dir)  # `latest` -> global_step2, read from both ranks' files
    assert "2 rank files, ZeRO stage 3" in sharded.source and "step 2" in sharded.source
    _same_weights(sharded.model, states[task][1])
    older = load(save_dir, tag="global_step1")
    _same_weights(older.model, states[task][0])

    export = consolidate(save_dir, tmp_path / "export")
    export_served = load(export, tokenizer=str(save_dir))
    _same_weights(export_served.model, states[task][1])
    assert (
        sharded.task == export_served.task == ("chat" if task == "chat" else "text-classification")
    )

    # batching off: which texts share a batch would move scores by ~1e-7 (test_classify)
    with live_server(sharded, max_new_tokens=8, max_batch_size=1) as url:
        a = _answers(url, task)
    with live_server(export_served, max_new_tokens=8, max_batch_size=1) as url:
        b = _answers(url, task)
    if task == "chat":
        assert a == b
    else:
        assert [x["label"] for x in a] == [y["label"] for y in b]
        assert [x["score"] for x in a] == pytest.approx([y["score"] for y in b], abs=evaluation())
