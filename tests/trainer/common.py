"""Shared pieces of the Trainer tests: a padded causal-LM dataset, its collator, a tiny
model without a ``labels`` argument (seed 003's shape), and one-call training runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.models import Decoder, DecoderConfig

TINY = DecoderConfig(
    vocab_size=50, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16, seed=5
)


def lm_rows(n: int = 32, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows of 3..12 tokens: padding makes label-token counts differ between batches."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 13, (1,), generator=g))
        ids = torch.randint(1, TINY.vocab_size, (length,), generator=g)
        rows.append({"input_ids": ids})
    return rows


def pad_collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad with 0; labels -100 on padding (a causal model never attends forward)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = f["input_ids"]
        labels[i, :n] = f["input_ids"]
    return {"input_ids": ids, "labels": labels}


class BasicNet(nn.Module):
    """Seed 003's shape: ``forward(x)`` returns log-probabilities and takes no labels."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(torch.tanh(self.fc1(x))), dim=1)


def xy_rows(n: int, seed: int = 1) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return [(x[i], int(y[i])) for i in range(n)]


def xy_collate(examples):
    return {
        "x": torch.stack([e[0] for e in examples]),
        "labels": torch.tensor([e[1] for e in examples]),
    }


def train_lm(
    out: str, per_device: int, accumulation: int, rows: int = 32, callbacks=None, **kw
) -> tuple[list[float], dict]:
    """Train the tiny decoder; return (per-step logged losses, final weights)."""
    from meshtrain import Trainer, TrainingArguments

    resume = kw.pop("resume_from_checkpoint", None)
    args = TrainingArguments(
        out,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=2,
        learning_rate=1e-3,
        logging_steps=1,
        disable_tqdm=True,
        **{"save_strategy": "no", **kw},
    )
    model = Decoder(TINY)
    trainer = Trainer(
        model, args, train_dataset=lm_rows(rows), data_collator=pad_collate, callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
