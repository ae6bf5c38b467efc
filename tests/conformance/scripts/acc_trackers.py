"""Experiment tracking as accelerate's examples do it: log_with="all" under project_dir,
init_trackers with the run's config, a log call per epoch, end_training."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator  # peer-import


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    args = parser.parse_args()

    accelerator = Accelerator(log_with="all", project_dir=args.output_dir)
    config = {"lr": 0.05, "epochs": 3, "batch_size": 8}
    accelerator.init_trackers("regression", config)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))
    loader = DataLoader(data, batch_size=config["batch_size"], shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(config["epochs"]):
        total = 0.0
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += accelerator.reduce(loss.detach(), reduction="mean").item()
        accelerator.log({"train_loss": total / len(loader), "epoch": epoch}, step=epoch)
        accelerator.print(f"epoch {epoch}: train_loss {total / len(loader):.6f}")
    accelerator.end_training()
    accelerator.save_model(model, f"{args.output_dir}/model")


if __name__ == "__main__":
    main()
