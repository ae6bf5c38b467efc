"""A Trainer ``checkpoint-N`` folder is a transformers checkpoint with meshtrain's
sharded state beside it (issue 27): ``model.safetensors`` + ``config.json``, the
tokenizer, ``trainer_state.json``, ``training_args.json`` (JSON, never a pickle) and the
engine's shards (optimizer and scheduler state, data position: ``manifest.json``).
``AutoModelForSequenceClassification.from_pretrained`` on the folder gives the trained
model's logits exactly (the same fp32 tensors run the same ops), and ``meshtrain
serve``'s loader serves the folder with the same logits; over real HTTP (uvicorn on a
free port, as tests/serve does), ``POST /classify`` answers each text with the label and
score of the trained model's own softmax on that text (within ``evaluation()``,
``tests/tolerance.py``: the same fp32 logits, one softmax each, possibly in another
batch; the server tokenizes the text alone, as the reference does).

One rank, forked (the test process never holds a process group)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import evaluation

HTTP_TEXTS = ["房间太小，服务很差", "我觉得不错!", "good", "还行吧"]


def _run(out: str) -> dict:
    import transformers

    from meshtrain import Trainer, TrainingArguments
    from meshtrain.serve.model_loading import load
    from tests.serve.models import bert_config, bert_tokenizer, reviews

    tok = bert_tokenizer()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(bert_config(tok))
    texts = reviews(32)
    enc = tok(texts, truncation=True, max_length=16, padding="max_length")
    rows = [
        {
            "input_ids": enc["input_ids"][i],
            "attention_mask": enc["attention_mask"][i],
            "labels": i % 2,
        }
        for i in range(len(texts))
    ]
    args = TrainingArguments(
        out,
        per_device_train_batch_size=8,
        max_steps=4,
        save_steps=2,
        learning_rate=1e-3,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(model, args, train_dataset=rows, processing_class=tok)
    trainer.train()
    folder = os.path.join(out, "checkpoint-4")
    batch = {k: torch.tensor([rows[0][k], rows[1][k]]) for k in ("input_ids", "attention_mask")}
    model.eval()
    with torch.no_grad():
        trained = model(**batch).logits
        loaded = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
        reloaded = loaded(**batch).logits
        served = load(folder)
        served_logits = served.model(**batch).logits
        direct = []  # the trained model on each text alone: what /classify must answer
        for text in HTTP_TEXTS:
            probs = model(**tok(text, return_tensors="pt")).logits.softmax(-1)[0]
            k = int(probs.argmax())
            direct.append((model.config.id2label[k], float(probs[k])))
    args_json = json.loads(Path(folder, "training_args.json").read_text())
    return {
        "direct": direct,
        "files": sorted(os.listdir(folder)),
        "checkpoints": sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")),
        "same_from_pretrained": torch.equal(trained, reloaded),
        "same_served": torch.equal(trained, served_logits),
        "task": served.task,
        "args_steps": args_json["max_steps"],
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("trainer_out")
    return str(out), run_ranks(_run, 1, str(out), timeout=600)[0]


def test_checkpoint_folder_is_a_transformers_checkpoint(trained):
    got = trained[1]
    files = set(got["files"])
    assert {"config.json", "model.safetensors", "trainer_state.json", "training_args.json"} <= files
    assert "tokenizer.json" in files or "tokenizer_config.json" in files
    assert "manifest.json" in files  # meshtrain's sharded state (optimizer, scheduler, data)
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files)  # no pickle
    assert got["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert got["same_from_pretrained"] and got["same_served"]
    assert got["task"] == "text-classification" and got["args_steps"] == 4


def test_meshtrain_serve_answers_from_a_checkpoint_folder_over_http(trained):
    """``meshtrain serve out/checkpoint-4``: the CLI's loader on the Trainer's folder, a real
    uvicorn server, ``POST /classify`` one text at a time and as a list."""
    httpx = pytest.importorskip("httpx")
    from meshtrain.serve.model_loading import load
    from tests.serve.conftest import live_server

    out, got = trained
    served = load(os.path.join(out, "checkpoint-4"))
    with live_server(served, max_batch_size=1) as url:
        alone = [
            httpx.post(f"{url}/classify", json={"text": t}, timeout=60).json() for t in HTTP_TEXTS
        ]
        listed = httpx.post(f"{url}/classify", json={"text": HTTP_TEXTS}, timeout=60).json()
        info = httpx.get(f"{url}/", timeout=60).json()
    assert "checkpoint-4" in info["source"] and info["task"] == "text-classification", info
    for (label, score), a, b in zip(got["direct"], alone, listed, strict=True):
        assert a["label"] == b["label"] == label, (a, b, label)
        assert a["score"] == pytest.approx(score, abs=evaluation())  # probabilities <= 1
        assert b["score"] == pytest.approx(score, abs=evaluation())
