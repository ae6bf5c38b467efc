"""A partial gradient-accumulation window at the end of a prepared dataloader is stepped.

40 rows, global batch 8 (5 batches an epoch), ``gradient_accumulation_steps=3``, 2
epochs, no shuffling: inside ``accumulate`` the windows are batches [0, 1, 2] and [3, 4]
of each epoch, as with accelerate, whose loader end forces ``sync_gradients`` (and resets
its window counter: the next epoch starts a fresh window). The reference is
accelerate's own ``Accelerator(cpu=True)`` in one process; meshtrain runs at 1 process and
at 2 processes (ZeRO stages 0 and 3, which reduce on the boundary backward only and on
every backward). Asserted: the ``sync_gradients`` sequence and the optimizer step count
equal accelerate's, and the parameters (normwise, each tensor within ``per_tensor``) are
within ``trajectory(1e-2, 4)`` of accelerate's (``tests/tolerance.py``; fp32, no dropout;
the runs differ only in the order of the gradient sums and in AdamW's kernels, foreach or
not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.harness import run_ranks
from tests.tolerance import check_weights, trajectory

ROWS, GLOBAL_BATCH, GAS, EPOCHS = 40, 8, 3, 2


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(ROWS, 8, generator=g), torch.randint(0, 4, (ROWS,), generator=g)
    )


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _loop(acc, model, opt, loader) -> list[bool]:
    syncs = []
    model.train()
    for _ in range(EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(F.cross_entropy(model(x), y))
                syncs.append(bool(acc.sync_gradients))
                opt.step()
                opt.zero_grad()
    return syncs


def _run(library: str, stage: int = 0) -> dict:
    world = torch.distributed.get_world_size()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // world)
    if library == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    else:
        from meshtrain import Accelerator

        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        acc = Accelerator(gradient_accumulation_steps=GAS, config={"zero_optimization": zero})
    model, opt, loader = acc.prepare(model, opt, loader)
    syncs = _loop(acc, model, opt, loader)
    if library == "accelerate":
        steps = int(next(iter(opt.optimizer.state.values()))["step"])  # AdamW's own count
        params = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    else:
        steps = acc.engine.global_steps
        params = acc.get_state_dict(model)
    return {"syncs": syncs, "steps": steps, "params": params}


def _one() -> dict:
    return {"accelerate": _run("accelerate"), "meshtrain": _run("meshtrain")}


def _two() -> dict:
    return {stage: _run("meshtrain", stage) for stage in (0, 3)}


def test_loader_end_steps_the_partial_window_like_accelerate():
    one = run_ranks(_one, 1)[0]
    two = run_ranks(_two, 2)
    ref = one["accelerate"]
    assert ref["syncs"] == [False, False, True, False, True] * EPOCHS
    assert ref["steps"] == 2 * EPOCHS
    runs = [("1 process", one["meshtrain"])]
    runs += [(f"rank {r} stage {s}", two[r][s]) for r in (0, 1) for s in (0, 3)]
    for name, got in runs:
        assert got["syncs"] == ref["syncs"], name
        assert got["steps"] == ref["steps"], name
        check_weights(name, got["params"], ref["params"], trajectory(1e-2, ref["steps"]))
