"""A tiny GPT-2 (built from a config, no download) fine-tuned as a causal LM with
Accelerate's gradient accumulation, a linear schedule and gradient clipping; the loss is
averaged over the processes and printed at every optimizer step, the weights saved."""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from accelerate import Accelerator  # peer-import


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--accumulation", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation)
    torch.manual_seed(3)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(11)
    rows = [{"input_ids": torch.randint(0, 96, (16,), generator=g)} for _ in range(48)]

    def collate(batch):
        ids = torch.stack([r["input_ids"] for r in batch])
        return {"input_ids": ids, "labels": ids.clone()}

    loader = DataLoader(rows, batch_size=4, shuffle=True, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, 2 * len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step = 0
    for _ in range(2):
        model.train()
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.print(
                    f"step {step}: loss {mean:.6f} lr {scheduler.get_last_lr()[0]:.6e}"
                )
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)


if __name__ == "__main__":
    main()
