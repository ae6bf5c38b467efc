"""Local SGD with Accelerate (accelerate.local_sgd.LocalSGD, as its examples/by_feature
script uses it): each process steps on its own gradients inside model.no_sync(), and
every 4 steps the parameters are averaged over the processes."""

import argparse

import torch
import torch.nn.functional as F
from accelerate.local_sgd import LocalSGD
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# isort: split
from accelerate import Accelerator  # peer-import


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 4, generator=g)
    loader = DataLoader(TensorDataset(x, x.cos().sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=4, enabled=True) as sgd:
            for xb, yb in loader:
                with accelerator.no_sync(model):
                    loss = F.mse_loss(model(xb), yb)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                sgd.step()
        mean = accelerator.reduce(loss.detach(), reduction="mean").item()
        accelerator.print(f"epoch {epoch}: loss {mean:.7f}")
    accelerator.save_model(model, args.output_dir)


if __name__ == "__main__":
    main()
