"""Shared pieces of the parity tests: tiny models, deterministic data, the one-process
reference loop and the same loop through the engine.

Parity protocol: one process trains on the global batch B = N x m x k per step; the
engine on N ranks trains with micro-batch m and k accumulation steps, rank r taking rows
[r*m*k, (r+1)*m*k) of the same global batch (micro-step i uses its i-th m rows). With
per-rank mean losses and gradients averaged over ranks and accumulation steps, both
compute the same mean gradient, up to floating-point summation order.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from meshtrain.models import Decoder, DecoderConfig
from tests.tolerance import normwise

TINY_DECODER = DecoderConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16, seed=11
)
SEQ = 8


class PlainNet(nn.Module):
    """A non-transformer model: MLP regression with a loss, returning the loss."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.body = nn.Sequential(
                nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.GELU(), nn.Linear(24, 3)
            )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x), y)


def make_model(kind: str) -> nn.Module:
    """ "decoder", "tied" (the decoder with lm_head tied to the embedding) or "plain"."""
    if kind == "tied":
        return Decoder(replace(TINY_DECODER, tie_embeddings=True))
    return Decoder(TINY_DECODER) if kind == "decoder" else PlainNet()


def global_batch(kind: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind in ("decoder", "tied"):
        ids = torch.randint(0, TINY_DECODER.vocab_size, (size, SEQ), generator=g)
        return ids, ids
    x = torch.randn(size, 12, generator=g)
    return x, torch.randn(size, 3, generator=g)


def reference_run(kind, steps, batch, lr=1e-3, clip=0.0, frozen=(), optimizer="AdamW", chunks=1):
    """One process on the global batch: returns (losses, state_dict).

    ``chunks > 1`` accumulates the gradient over that many equal slices of the batch
    (each slice's mean loss / chunks), the same arithmetic a layout with N ranks x k
    accumulation steps does, so only the order of the final sum differs."""
    torch.manual_seed(0)
    model = make_model(kind)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (
        torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        if optimizer == "AdamW"
        else torch.optim.SGD(params, lr=lr, momentum=0.9)
    )
    losses = []
    for step in range(steps):
        x, y = global_batch(kind, step, batch)
        n = batch // chunks
        loss = 0.0
        for c in range(chunks):
            part = model(x[c * n : (c + 1) * n], y[c * n : (c + 1) * n]) / chunks
            part.backward()
            loss += part.detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_engine(kind, micro, accum, config_extra=None, lr=1e-3, frozen=(), optimizer="AdamW"):
    """Inside a rank: the test model (``frozen`` names frozen) through meshtrain.initialize."""
    import meshtrain

    torch.manual_seed(0)
    model = make_model(kind)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    opt_cfg = (
        {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}
        if optimizer == "AdamW"
        else {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}
    )
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": opt_cfg,
        "steps_per_print": 1000,
        **(config_extra or {}),
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def train_steps(engine, kind, steps, micro, accum, first_step=0):
    """Run ``steps`` optimizer steps of the parity protocol (module docstring).

    Returns (losses averaged over ranks per step, per-step comm bytes by op, comm bytes
    of non-boundary micro-steps)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    losses, step_bytes, off_boundary = [], [], []
    per_rank = micro * accum
    for step in range(first_step, first_step + steps):
        x, y = global_batch(kind, step, per_rank * world)
        x, y = (
            x[rank * per_rank : (rank + 1) * per_rank],
            y[rank * per_rank : (rank + 1) * per_rank],
        )
        step_loss = 0.0
        for i in range(accum):
            before = engine.topology.stats.total()
            loss = engine(x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro])
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if not boundary:
                off_boundary.append(engine.topology.stats.total() - before)
            step_loss += loss.item() / accum
        t = torch.tensor([step_loss], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        step_bytes.append(engine.last_step_comm_bytes())
    return losses, step_bytes, off_boundary


def engine_run(kind, steps, micro, accum, config_extra=None, lr=1e-3, frozen=(), optimizer="AdamW"):
    """Inside a rank: the same training through meshtrain.initialize.

    Returns (losses averaged over ranks per step, state dict, per-step comm bytes by op,
    comm bytes of non-boundary micro-steps)."""
    engine = make_engine(kind, micro, accum, config_extra, lr, frozen, optimizer)
    losses, step_bytes, off_boundary = train_steps(engine, kind, steps, micro, accum)
    return losses, engine.module_state_dict(), step_bytes, off_boundary


# Normwise, not elementwise (tests/tolerance.py says why): the name the parity tests use.
max_rel_diff = normwise
