"""What a user's script draws and in which order, under accelerate and under meshtrain:
the shuffled loader's own ``generator=``, the default generator, a ``break`` out of a
prepared loader, ``skip_first_batches``, ``model.no_sync()``, and the global RNG the
script's dropout draws from. ``run(impl)`` runs one script's worth of these on every rank
and returns plain values; the test compares the two libraries' results.

Everything here is our own code written after accelerate's multi-process checks
(``test_utils/scripts/test_distributed_data_loop.py``, ``test_sync.py``): only the
``Accelerator`` import differs between the two runs.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conformance.accelerate.checks import accelerator

ROWS = 40


def rng_digest() -> str:
    """A short digest of the global torch RNG state (what dropout and randn draw from)."""
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]


def _order(loader) -> list[int]:
    return [int(v) for (b,) in loader for v in b]


def loader_orders(impl: str) -> dict:
    """The batches each rank sees: 3 epochs of a loader with ``generator=``; a pass left by
    ``break`` then the next one; ``skip_first_batches``; the default generator's epochs;
    and the user generator's state afterwards."""
    acc = accelerator(impl)
    out: dict = {}
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(42)
    dl = acc.prepare(
        DataLoader(TensorDataset(torch.arange(ROWS)), batch_size=4, shuffle=True, generator=g)
    )
    out["generator epochs"] = [_order(dl) for _ in range(3)]
    for (b,) in dl:  # early stopping after the first batch
        out["before break"] = b.tolist()
        break
    out["after break"] = _order(dl)
    skipped = acc.skip_first_batches(dl, 2)
    out["skipped"] = (len(skipped), _order(skipped))
    out["after skip"] = _order(dl)
    out["generator after"] = int(torch.randint(0, 2**30, (1,), generator=g))
    out["rng after generator loader"] = rng_digest()
    torch.manual_seed(3)
    dl2 = acc.prepare(DataLoader(TensorDataset(torch.arange(ROWS)), batch_size=4, shuffle=True))
    out["rng after prepare"] = rng_digest()
    out["default epochs"] = [_order(dl2) for _ in range(2)]
    for _ in dl2:
        break
    out["default after break"] = _order(dl2)
    out["rng after default loader"] = rng_digest()
    return out


class DropoutNet(nn.Module):
    """A small MLP with dropout: its masks come from the global RNG, so it trains the same
    only if nothing else drew from that stream."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g))


def train_with_generator(impl: str, gas: int) -> dict:
    """accelerate's loop over a loader with its own generator, dropout on: 3 epochs, with
    ``gas`` accumulation steps; returns the final parameters and the RNG digest at
    prepare (the set-up must not draw)."""
    acc = accelerator(impl, gradient_accumulation_steps=gas)
    torch.manual_seed(11)
    model = DropoutNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(42)
    loader = DataLoader(_data(), batch_size=8, shuffle=True, generator=g)
    before = rng_digest()
    model, opt, loader = acc.prepare(model, opt, loader)
    unchanged = rng_digest() == before
    for _ in range(3):
        model.train()
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
    params = {k: v.detach().clone().cpu() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {"params": params, "prepare drew nothing": unchanged, "rng end": rng_digest()}


def no_sync_grads(impl: str) -> dict:
    """``model.no_sync()`` on a prepared model: a backward inside leaves each rank's own
    gradient (rank-dependent data), one outside averages them. Several processes only:
    in one, accelerate does not wrap the model in DDP, which is what has ``no_sync``."""
    acc = accelerator(impl)
    if acc.num_processes == 1:
        return {"local": [], "synced": []}
    torch.manual_seed(5)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.full((2, 3), float(acc.process_index + 1))
    with model.no_sync():
        acc.backward(model(x).sum())
    local = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    acc.backward(model(x).sum())
    synced = [p.grad.clone() for p in model.parameters()]
    return {"local": local, "synced": synced}


def run(impl: str) -> dict:
    out = {"orders": loader_orders(impl)}
    for gas in (1, 2):
        out["train", gas] = train_with_generator(impl, gas)
    out["no_sync"] = no_sync_grads(impl)
    return out
