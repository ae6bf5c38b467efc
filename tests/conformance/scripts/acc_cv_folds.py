"""K-fold cross-validation with Accelerate: a fresh model, optimizer and shuffled loader
prepared for every fold (each prepare draws the fold's shuffle seed from the global RNG),
dropout on, the fold's validation accuracy printed and the last fold's weights saved."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from accelerate import Accelerator  # peer-import


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--folds", type=int, default=3)
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(120, 8, generator=g)
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long()
    data = TensorDataset(x, y)
    fold_size = len(data) // args.folds
    for fold in range(args.folds):
        held = list(range(fold * fold_size, (fold + 1) * fold_size))
        kept = [i for i in range(len(data)) if i not in set(held)]
        model = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Dropout(0.3), nn.Linear(24, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        train = DataLoader(Subset(data, kept), batch_size=10, shuffle=True)
        valid = DataLoader(Subset(data, held), batch_size=10)
        model, optimizer, train, valid = accelerator.prepare(model, optimizer, train, valid)
        for _ in range(3):
            model.train()
            for xb, yb in train:
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        correct = 0
        for xb, yb in valid:
            with torch.no_grad():
                pred = model(xb).argmax(-1)
            pred, yb = accelerator.gather_for_metrics((pred, yb))
            correct += (pred == yb).sum().item()
        accelerator.print(f"fold {fold}: accuracy {correct / len(held):.4f} loss {loss.item():.6f}")
        accelerator.free_memory()
    accelerator.save_model(model, args.output_dir)


if __name__ == "__main__":
    main()
