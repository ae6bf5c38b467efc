"""fp16 under the Accelerator at ZeRO stage 0: after ``optimizer.step()`` ``p.grad`` is the
unscaled gradient, as accelerate's ``GradScaler.step`` leaves it (it unscales in place
unless ``unscale_``/``clip_grad_norm_`` did already), and kept until ``zero_grad()``.

Exact equalities: the loss scale is a power of two, so dividing fp16 gradients by it is
exact (no subnormals at these magnitudes); the clipped case must not be divided twice.
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks


def _run() -> dict:
    from torch import nn

    from meshtrain import Accelerator

    out = {}
    for clip in (False, True):
        # a small loss scale: the gradients stay finite (65536 overflows fp16 here)
        acc = Accelerator(
            mixed_precision="fp16", config={"fp16": {"enabled": True, "initial_scale_power": 4}}
        )
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        params = list(acc.unwrap_model(model).parameters())
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        acc.backward(model(x).float().pow(2).sum())
        if clip:
            acc.clip_grad_norm_(model.parameters(), 1e6)  # unscales, clips nothing
        before = [p.grad.detach().clone() for p in params]
        scale = acc.engine.scaler.scale
        opt.step()
        after = [p.grad.detach().clone() for p in params]
        opt.zero_grad()
        out[clip] = {
            "scale": scale,
            "finite": all(bool(torch.isfinite(b).all()) for b in before),
            "stepped": acc.engine.was_step_applied(),
            "unscaled": all(
                torch.equal(a, b if clip else b / scale) for a, b in zip(after, before, strict=True)
            ),
            "none_after_zero_grad": all(p.grad is None for p in params),
        }
    return out


def test_fp16_grad_after_step_is_unscaled_once():
    got = run_ranks(_run, 1)[0]
    assert got[False]["scale"] > 1  # the gradients really carried a loss scale
    for clip in (False, True):
        assert got[clip]["finite"] and got[clip]["stepped"], (clip, got[clip])
        assert got[clip]["unscaled"], clip
        assert got[clip]["none_after_zero_grad"], clip
