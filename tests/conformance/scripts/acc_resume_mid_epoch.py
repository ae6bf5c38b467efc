"""Checkpoint and resume mid-epoch as accelerate's examples do: save_state every few
steps into step_<n>; a later run given --resume_from_checkpoint loads it, works out the
epoch and the step inside it from the folder name, and skips the batches already seen
with skip_first_batches."""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator  # peer-import


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--checkpointing_steps", type=int, default=5)
    parser.add_argument("--stop_after", type=int, default=None)
    parser.add_argument("--resume_from_checkpoint", default=None)
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 5, generator=g)
    loader = DataLoader(TensorDataset(x, x.sin().sum(1, keepdim=True)), batch_size=4, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=0.7)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    steps_per_epoch = len(loader)

    starting_epoch, resume_step, completed = 0, None, 0
    if args.resume_from_checkpoint:
        accelerator.print(f"step resumed from {os.path.basename(args.resume_from_checkpoint)}")
        accelerator.load_state(args.resume_from_checkpoint)
        completed = int(os.path.basename(args.resume_from_checkpoint).split("_")[1])
        starting_epoch = completed // steps_per_epoch
        resume_step = completed - starting_epoch * steps_per_epoch

    for epoch in range(starting_epoch, 2):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step:
            active = accelerator.skip_first_batches(loader, resume_step)
        else:
            active = loader
        for xb, yb in active:
            loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            completed += 1
            mean = accelerator.reduce(loss.detach(), reduction="mean").item()
            accelerator.print(f"step {completed}: epoch {epoch} loss {mean:.7f}")
            if completed % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed}"))
            if args.stop_after and completed == args.stop_after:
                return
    accelerator.save_model(model, os.path.join(args.output_dir, "final"))


if __name__ == "__main__":
    main()
