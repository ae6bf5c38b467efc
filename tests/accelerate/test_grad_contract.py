"""What ``p.grad`` holds under the Accelerator, and a 2-process loop against 1 process.

The loop is accelerate's documented shape with everything a user looks at: inside
``accumulate(model)`` (``gradient_accumulation_steps=2``) it records ``p.grad`` after each
backward, and only when ``sync_gradients`` clips (``clip_grad_norm_``), records the
returned norm and the clipped ``p.grad``, then ``optimizer.step()`` / ``zero_grad()``.
The reference is plain PyTorch in one process on the same global batch (8 rows = 2 ranks
x 4): ``(loss / 2).backward()``, ``clip_grad_norm_``, ``step``.

Asserted at ZeRO stage 0 (``p.grad`` is the flat buffer's view): inside a window each
rank's ``p.grad`` is its own local gradient (not the reference's); at the sync step it is
the reference's averaged gradient; after clipping it is the reference's clipped gradient
and the returned norm is the reference's pre-clip norm. At ZeRO stage 1 (DeepSpeed's
contract, which accelerate hands ZeRO to): after the sync backward ``p.grad`` is None and
``meshtrain.utils.safe_get_full_grad(p)`` is the reference's averaged gradient. At stages
0, 1 and 2 the parameters
after 3 optimizer steps equal the reference's. Tolerances (``tests/tolerance.py``): fp32,
no dropout; the runs differ only in summation order (two 4-row means averaged against one
8-row mean). Gradients, normwise per tensor: ``gradient()`` in the first window (identical
weights), ``gradient_from`` the parameter bound after it; the clipping norms within
``norm_from`` it; the parameters within ``per_tensor`` of ``trajectory(1e-2, 3)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.harness import run_ranks
from tests.tolerance import (
    check,
    gradient,
    gradient_from,
    norm_from,
    per_tensor,
    relative,
    trajectory,
)

ROWS, GLOBAL, GAS, CLIP = 48, 8, 2, 0.3


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)
    )


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _grads(params) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in params]


def _reference() -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = {"grads": [], "norms": [], "clipped": []}
    for i, (x, y) in enumerate(DataLoader(_data(), batch_size=GLOBAL)):
        (F.cross_entropy(model(x), y) / GAS).backward()
        rec["grads"].append(_grads(model.parameters()))
        if (i + 1) % GAS == 0:
            rec["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            rec["clipped"].append(_grads(model.parameters()))
            opt.step()
            opt.zero_grad()
    rec["params"] = [p.detach().clone() for p in model.parameters()]
    return rec


def _run(stage: int) -> dict:
    from meshtrain import Accelerator

    world = torch.distributed.get_world_size()
    acc = Accelerator(
        gradient_accumulation_steps=GAS,
        config={"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
    )
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=GLOBAL // world)
    model, opt, loader = acc.prepare(model, opt, loader)
    params = list(acc.unwrap_model(model).parameters())
    rec = {"grads": [], "syncs": [], "norms": [], "clipped": [], "full": [], "none": []}
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            rec["syncs"].append(acc.sync_gradients)
            if stage == 0:
                rec["grads"].append(_grads(params))
            if stage == 1 and acc.sync_gradients:
                from meshtrain.utils import safe_get_full_grad

                rec["none"].append(all(p.grad is None for p in params))
                rec["full"].append([safe_get_full_grad(p).clone() for p in params])
            if acc.sync_gradients:
                rec["norms"].append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                if stage == 0:
                    rec["clipped"].append(_grads(params))
                opt.step()
                opt.zero_grad()
    rec["params"] = [v for v in acc.get_state_dict(model).values()]
    return rec


def _both() -> dict:
    return {stage: _run(stage) for stage in (0, 1, 2)}


PARAMS_TOL = trajectory(1e-2, 3)  # 3 AdamW steps at lr 1e-2


def _close(a, b, bound) -> bool:
    """Every tensor of ``a`` within ``bound`` of ``b``'s, normwise relative."""
    return all(relative(x, y) <= bound for x, y in zip(a, b, strict=True))


def _grad_bound(i: int) -> float:
    """Micro-step ``i``'s gradients: from identical weights in the first window."""
    return gradient() if i < GAS else gradient_from(PARAMS_TOL)


def _params_close(a, b) -> bool:
    numel = sum(t.numel() for t in b)
    return all(
        relative(x, y) <= per_tensor(PARAMS_TOL, numel, y.numel())
        for x, y in zip(a, b, strict=True)
    )


def test_grads_follow_accelerates_contract_and_two_processes_match_one():
    ref = _reference()
    ranks = run_ranks(_both, 2)
    steps = ROWS // GLOBAL
    for rank, out in enumerate(ranks):
        for stage in (0, 1, 2):
            got = out[stage]
            assert got["syncs"] == [(i + 1) % GAS == 0 for i in range(steps)], (rank, stage)
            numel = sum(t.numel() for t in ref["params"])
            for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
                check(
                    f"rank {rank} stage {stage} norm {step}",
                    abs(a - b) / b,
                    norm_from(PARAMS_TOL, numel),
                )
            assert _params_close(got["params"], ref["params"]), (rank, stage)
        got = out[0]
        for i in range(steps):
            if (i + 1) % GAS == 0:  # after the sync backward: the averaged global gradient
                assert _close(got["grads"][i], ref["grads"][i], _grad_bound(i)), (rank, i)
            else:  # inside the window: this rank's own half-batch gradient, not the global one
                assert not _close(got["grads"][i], ref["grads"][i], 1e-4), (rank, i)
        for w, (a, b) in enumerate(zip(got["clipped"], ref["clipped"], strict=True)):
            assert _close(a, b, _grad_bound(w * GAS)), rank
        z1 = out[1]  # ZeRO-1: p.grad None, the full averaged gradient assembled on request
        assert z1["none"] == [True] * (steps // GAS), (rank, z1["none"])
        syncs = [i for i in range(steps) if (i + 1) % GAS == 0]
        for full, i in zip(z1["full"], syncs, strict=True):
            assert _close(full, ref["grads"][i], _grad_bound(i)), (rank, i)
    # the local gradients of the two ranks average to the reference's
    for i in range(0, steps, GAS):
        mean = [
            (a + b) / 2
            for a, b in zip(ranks[0][0]["grads"][i], ranks[1][0]["grads"][i], strict=True)
        ]
        assert _close(mean, ref["grads"][i], _grad_bound(i)), i
