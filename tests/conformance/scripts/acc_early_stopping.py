"""A regression MLP with dropout trained with Accelerate, evaluated each epoch with
gather_for_metrics, stopping early when the validation loss stops improving; the
shuffled training loader has its own seeded generator."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator  # peer-import


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, :3].sum(1) - x[:, 3:].prod(1)).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--patience", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    train = DataLoader(
        make_data(96, 1), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(42)
    )
    valid = DataLoader(make_data(30, 2), batch_size=8)
    model, optimizer, train, valid = accelerator.prepare(model, optimizer, train, valid)

    best, bad = float("inf"), 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train:
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        total, count = 0.0, 0
        for x, y in valid:
            with torch.no_grad():
                pred = model(x)
            pred, y = accelerator.gather_for_metrics((pred, y))
            total += F.mse_loss(pred, y, reduction="sum").item()
            count += y.shape[0]
        val = total / count
        accelerator.print(f"epoch {epoch}: val_loss {val:.6f} rows {count}")
        if val < best - 1e-4:
            best, bad = val, 0
        else:
            bad += 1
            if bad >= args.patience:
                accelerator.print(f"epoch {epoch}: early stop, best {best:.6f}")
                break
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)


if __name__ == "__main__":
    main()
