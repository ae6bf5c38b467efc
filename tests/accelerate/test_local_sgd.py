"""accelerate's ``LocalSGD`` on a meshtrain Accelerator, at 2 processes.

``LocalSGD`` (``accelerate.local_sgd``) runs ``optimizer.step()`` after backward passes
inside ``no_sync`` (each rank steps on its own gradient, as DDP does) and every
``local_sgd_steps`` averages the parameters with ``param.data = reduce(param.data)``. Two
things meshtrain must do for it: step on the local gradient instead of reducing at the
step (``EngineDriver.keep_local``), and take back the reassigned parameters into the
engine's flat storage (``parallel.zero.rebound``; without it the model froze at the
first average, and ``save_model``, which cuts its file from that storage, wrote the
weights from before the last average). Reference: the same loop by hand in plain torch (each rank its own model
copy, SGD on its own gradient, the parameters all-reduced and divided by the world size
every 3 steps). Same operations in the same order (SGD is element-wise, ZeRO-0 with fp32
masters aliasing the parameters, the same all-reduce): the parameters are compared
exactly (``tests/tolerance.py`` rule 1).

At ZeRO stage 1 a rank steps only its slice of the masters, and at stages 2-3 every
backward reduce-scatters, so a step after a window all inside ``no_sync`` is refused by
name there (a ConfigError), not run silently as plain data parallelism.
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


def _meshtrain(stage: int, out_dir: str) -> dict:
    from accelerate.local_sgd import LocalSGD
    from safetensors.torch import load_file

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
    # the exit averaged once more; the next forward, this read and the file see it
    state = {k: v.detach().clone() for k, v in model.engine.module_state_dict().items()}
    acc.save_model(model, out_dir)
    acc.wait_for_everyone()
    return {"state": state, "saved": load_file(f"{out_dir}/model.safetensors")}


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


def _refused(stage: int) -> str:
    from meshtrain import Accelerator
    from meshtrain.errors import ConfigError

    acc = Accelerator(config={"zero_optimization": {"stage": stage}})
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


def _ranks(out_dir: str) -> dict:
    refused = {stage: _refused(stage) for stage in (1, 2, 3)}
    return {"ours": _meshtrain(0, out_dir), "ref": _by_hand(), "refused": refused}


def test_local_sgd_equals_the_loop_by_hand_and_zero_1_to_3_refuse_it(tmp_path):
    for rank, out in enumerate(run_ranks(_ranks, 2, str(tmp_path), timeout=300)):
        for got in (out["ours"]["state"], out["ours"]["saved"]):
            assert got.keys() == out["ref"].keys()
            for name, ref in out["ref"].items():
                assert torch.equal(got[name], ref), (rank, name)
        for stage, message in out["refused"].items():
            assert f"ZeRO stage {stage}" in message and "no_sync" in message, message
