"""Rank functions of the accelerate resume proof (tests/interop/test_accelerate_resume.py).

One script, run by accelerate 1.15's ``Accelerator(cpu=True)`` and by meshtrain's with only
the class changed: a small module with a buffer, AdamW over two param groups (weights with
decay, biases and the rest without: the optimizer's order is not the module's), a StepLR
scheduler, a shuffled loader with the user's generator, a registered object, and
``accumulate``. accelerate trains it uninterrupted for ``EPOCHS`` epochs on 2 processes and
calls ``save_state`` after ``SAVE_AT`` steps (mid-epoch 0; once with safetensors, once with
``safe_serialization=False``). meshtrain builds the same objects from *another* seed (so
every weight it ends with came from the folder), ``load_state``s the folder, skips the
epoch's first ``SAVE_AT`` batches with ``skip_first_batches`` as accelerate's examples do,
and trains to the end.

The scheduler is stepped once per call (``step_scheduler_with_optimizer=False``) in every
run: accelerate's default steps it once per process per optimizer step, which gives
another schedule at another process count by design, and the 1-process resume is compared
with the 2-process run.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROWS, GLOBAL, EPOCHS, SAVE_AT, LR = 48, 8, 2, 3, 1e-2
STEPS_PER_EPOCH = ROWS // GLOBAL


class TinyNet(nn.Module):
    """Three linear layers and a persistent buffer the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.randn(8) * 0.1)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x - self.shift))
        return F.cross_entropy(self.out(torch.tanh(self.fc2(h))), y)


class Tally:
    """A registered object: steps seen and the sum of this rank's losses."""

    def __init__(self) -> None:
        self.seen = 0
        self.total = torch.zeros((), dtype=torch.float64)
        self.note = "fresh"

    def update(self, loss: torch.Tensor) -> None:
        self.seen += 1
        self.total += loss.detach().double()
        self.note = f"after {self.seen}"

    def state_dict(self) -> dict:
        return {"seen": self.seen, "total": self.total.clone(), "note": self.note}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.total, self.note = state["seen"], state["total"].clone(), state["note"]


class Dated(Tally):
    """A registered object whose state holds a type outside what weights_only allows."""

    def state_dict(self) -> dict:
        import datetime

        return {**super().state_dict(), "when": datetime.date(2026, 12, 3)}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 8, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long())


def draws() -> list:
    """What the global RNGs give next (torch, python, numpy): equal only if restored."""
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _build(impl: str, seed: int, stage: int):
    world = torch.distributed.get_world_size()
    if impl == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    else:
        from meshtrain import Accelerator

        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        acc = Accelerator(config={"zero_optimization": zero}, step_scheduler_with_optimizer=False)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = TinyNet()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=LR
    )
    loader = DataLoader(
        _data(),
        batch_size=GLOBAL // world,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    tally = Tally()
    acc.register_for_checkpointing(tally)
    return acc, model, opt, loader, sched, tally


def _mean(loss: torch.Tensor) -> float:
    t = loss.detach().double().reshape(1)
    torch.distributed.all_reduce(t)
    return float(t) / torch.distributed.get_world_size()


def _train(acc, model, opt, loader, sched, tally, completed: int, skip: int, on_step=None):
    """From ``completed`` steps to the end; returns (losses, lrs) of the steps run."""
    losses, lrs = [], []
    for _ in range(completed // STEPS_PER_EPOCH, EPOCHS):
        active = acc.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for x, y in active:
            with acc.accumulate(model):
                lrs.append(opt.param_groups[0]["lr"])
                loss = model(x, y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            tally.update(loss)
            completed += 1
            losses.append(_mean(loss))
            if on_step is not None:
                on_step(completed)
    return losses, lrs


def accelerate_writes(out: str) -> dict:
    """accelerate, uninterrupted, saving after ``SAVE_AT`` steps. Returns what follows the
    save (losses, lrs), what the state was at it, and the final weights."""
    # (a forked rank starts with no accelerate state: tests/conftest.py ends each test's)
    acc, model, opt, loader, sched, tally = _build("accelerate", 0, 0)
    at_save: dict = {}

    def save(completed: int) -> None:
        if completed == SAVE_AT:
            acc.save_state(f"{out}/step_{SAVE_AT}")
            acc.save_state(f"{out}/bin_{SAVE_AT}", safe_serialization=False)
            at_save.update(
                draws=draws(), tally=tally.state_dict(), step=acc.step,
                scheduler=sched.state_dict(),
            )  # fmt: skip

    losses, lrs = _train(acc, model, opt, loader, sched, tally, 0, 0, save)
    state = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {"losses": losses[SAVE_AT:], "lrs": lrs[SAVE_AT:], "at_save": at_save, "state": state}


def meshtrain_resumes(folder: str, stages: list[int]) -> dict:
    """meshtrain's Accelerator at each ZeRO stage: load_state the accelerate folder, skip
    the first ``SAVE_AT`` batches, train to the end."""
    out = {}
    for stage in stages:
        acc, model, opt, loader, sched, tally = _build("meshtrain", 1, stage)
        acc.load_state(folder)
        resumed = {
            "draws": draws(),
            "tally": tally.state_dict(),
            "step": acc.step,
            "scheduler": sched.state_dict(),
            "global_steps": acc.engine.global_steps,
        }
        skip = SAVE_AT % STEPS_PER_EPOCH
        losses, lrs = _train(acc, model, opt, loader, sched, tally, SAVE_AT, skip)
        out[stage] = {**resumed, "losses": losses, "lrs": lrs, "state": acc.get_state_dict(model)}
    return out


def meshtrain_bad_inputs(folders: dict) -> dict:
    """One process, ZeRO 1: ``load_state`` on each bad folder; the one-line messages."""
    from meshtrain.errors import CheckpointError

    out = {}
    for what, folder in folders.items():
        acc, *_ = _build("meshtrain", 1, 1)
        try:
            if what == "engine.load_checkpoint":  # the DeepSpeed-style door: pointed here
                acc.engine.load_checkpoint(folder)
            else:
                acc.load_state(folder)
            out[what] = None
        except CheckpointError as exc:
            out[what] = str(exc)
    return out


def dated_state(folder: str) -> None:
    """Write ``custom_checkpoint_0.pkl`` as accelerate would for a ``Dated`` object."""
    torch.save(Dated().state_dict(), f"{folder}/custom_checkpoint_0.pkl")
