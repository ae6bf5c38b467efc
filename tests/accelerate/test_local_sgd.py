"""accelerate's ``LocalSGD`` on a meshtrain Accelerator, at 2 processes.

``LocalSGD`` (``accelerate.local_sgd``) runs ``optimizer.step()`` after backward passes
inside ``no_sync`` (each rank steps on its own gradient, as DDP does) and every
``local_sgd_steps`` averages the parameters with ``param.data = reduce(param.data)``. Two
things meshtrain must do for it: step on the local gradient instead of reducing at the
step (``EngineDriver.keep_local``), and take back the reassigned parameters into the
engine's flat storage (``FlatGroup.adopt_rebound``; without it the model froze at the
first average). Reference: the same loop by hand in plain torch (each rank its own model
copy, SGD on its own gradient, the parameters all-reduced and divided by the world size
every 3 steps). Same operations in the same order (SGD is element-wise, ZeRO-0 with fp32
masters aliasing the parameters, the same all-reduce): the parameters are compared
exactly (``tests/tolerance.py`` rule 1).

At ZeRO stage 1 a rank steps only its slice of the masters, so a step after a window all
inside ``no_sync`` is refused by name (a ConfigError), not reduced silently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_ranks

STEPS, EVERY, ROWS, LR = 7, 3, 4, 0.05


def _model() -> nn.Module:
    torch.manual_seed(9)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _rows(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    return x, x.cos().sum(1, keepdim=True)


def _meshtrain(stage: int) -> dict:
    from accelerate.local_sgd import LocalSGD

    from meshtrain import Accelerator

    acc = Accelerator(config={"zero_optimization": {"stage": stage}})
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    rank = acc.process_index
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=EVERY, enabled=True) as sgd:
        for step in range(STEPS):
            x, y = _rows(step, rank)
            with acc.no_sync(model):
                acc.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            sgd.step()
    # the exit averaged once more; the next forward (or this read) sees the average
    return {k: v.detach().clone() for k, v in model.engine.module_state_dict().items()}


def _by_hand() -> dict:
    import torch.distributed as dist

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()

    def average():
        for p in model.parameters():
            t = p.data.clone()
            dist.all_reduce(t)
            p.data = t / world

    for step in range(STEPS):
        x, y = _rows(step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % EVERY == 0:
            average()
    average()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stage1_refused() -> str:
    from meshtrain import Accelerator
    from meshtrain.errors import ConfigError

    acc = Accelerator(config={"zero_optimization": {"stage": 1}})
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = _rows(0, acc.process_index)
    with acc.no_sync(model):
        acc.backward(F.mse_loss(model(x), y))
        try:
            opt.step()
        except ConfigError as e:
            return str(e)
    return ""


def _ranks() -> dict:
    return {"ours": _meshtrain(0), "ref": _by_hand(), "stage1": _stage1_refused()}


def test_local_sgd_equals_the_loop_by_hand_and_stage1_is_refused():
    for rank, out in enumerate(run_ranks(_ranks, 2, timeout=300)):
        assert out["ours"].keys() == out["ref"].keys()
        for name, ref in out["ref"].items():
            assert torch.equal(out["ours"][name], ref), (rank, name)
        assert "ZeRO stage 1" in out["stage1"] and "no_sync" in out["stage1"], out["stage1"]
