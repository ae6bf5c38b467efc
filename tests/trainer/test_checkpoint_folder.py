"""A Trainer ``checkpoint-N`` folder is a transformers checkpoint with meshtrain's
sharded state beside it (issue 27): ``model.safetensors`` + ``config.json``, the
tokenizer, ``trainer_state.json``, ``training_args.json`` (JSON, never a pickle) and the
engine's shards (optimizer and scheduler state, data position: ``manifest.json``).
``AutoModelForSequenceClassification.from_pretrained`` on the folder gives the trained
model's logits exactly (the same fp32 tensors run the same ops), and ``meshtrain
serve``'s loader serves the folder with the same logits.

One rank, forked (the test process never holds a process group)."""

from __future__ import annotations

import json
import os

import torch

from tests.harness import run_ranks


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
    args_json = json.loads(open(os.path.join(folder, "training_args.json")).read())
    return {
        "files": sorted(os.listdir(folder)),
        "checkpoints": sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")),
        "same_from_pretrained": torch.equal(trained, reloaded),
        "same_served": torch.equal(trained, served_logits),
        "task": served.task,
        "args_steps": args_json["max_steps"],
    }


def test_checkpoint_folder_is_a_transformers_checkpoint(tmp_path):
    got = run_ranks(_run, 1, str(tmp_path), timeout=600)[0]
    files = set(got["files"])
    assert {"config.json", "model.safetensors", "trainer_state.json", "training_args.json"} <= files
    assert "tokenizer.json" in files or "tokenizer_config.json" in files
    assert "manifest.json" in files  # meshtrain's sharded state (optimizer, scheduler, data)
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files)  # no pickle
    assert got["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert got["same_from_pretrained"] and got["same_served"]
    assert got["task"] == "text-classification" and got["args_steps"] == 4
