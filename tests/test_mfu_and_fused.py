"""MFU arithmetic of the step log and the fused-AdamW switch (single process, < 5 s).

MFU is exact arithmetic: (6N + 12 L d T) x tokens/s / (peak x dp), checked to 1e-12
relative (float rounding only). The fused switch is checked by the optimizer's own flags;
its deviation from foreach after 3 steps on the same gradients is the rounding of each
kernel's own elementwise order: each AdamW step rounds the parameter about 3 times (the
decay, the update, the moments' quotient), so two kernels differ by at most
``MARGIN x 3 x steps x u x max|p|`` (``tests/tolerance.py``; measured: about 5e-7 after 6
steps on values of order 1); the default is asserted bit-identical to a plain torch
AdamW(foreach=True).
"""

from __future__ import annotations

import torch

from meshtrain.engine import flops
from meshtrain.engine.step_log import StepLog
from meshtrain.optim.optimizers import build_optimizer
from tests.tolerance import MARGIN, unit_roundoff


def test_flops_per_token_and_step_log_mfu():
    assert flops.flops_per_token(1000, 2, 64, 32) == 6 * 1000 + 12 * 2 * 64 * 32
    log = StepLog(every=0, dp_size=2, is_logging_rank=False)
    log.set_mfu(6.0 * 1000, 12.0 * 2 * 64, peak_flops=1e9, source="test")
    log.count_batch((torch.zeros(4, 32, dtype=torch.long),), {})
    log.add_loss(torch.tensor(1.0))
    last = log.end_step(step=1, lr=0.1, loss_scale=1.0, grad_norm=None, comm_bytes=0, skipped=False)
    want = flops.flops_per_token(1000, 2, 64, 32) * last["tokens_per_s"] / (1e9 * 2)
    assert abs(last["mfu"] - want) <= 1e-12 * want
    assert last["mfu_peak_source"] == "test"
    assert "MFU" in log.format(last)


def test_gpu_table_and_cpu_peak_labelled_measured():
    assert dict(flops.GPU_PEAK_TFLOPS)["H100"]["bf16"] == 989.4
    peak, source = flops.peak_flops(torch.device("cpu"), torch.float32)
    assert peak > 0 and source.startswith("measured")


def test_fused_switch_default_is_bit_identical_foreach():
    torch.manual_seed(0)
    init, grads = torch.randn(1000), [torch.randn(1000) for _ in range(3)]
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    out = {}
    for fused in (None, True, "torch"):
        p = torch.nn.Parameter(init.clone())
        if fused == "torch":
            opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=True)
        else:
            extra = {} if fused is None else {"fused": fused}
            opt = build_optimizer("AdamW", {**hyper, **extra}, [{"params": [p]}])
            assert bool(opt.defaults.get("fused")) == bool(fused)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[fused] = p.detach()
    assert torch.equal(out[None], out["torch"])
    roundings = 3 * len(grads)  # per step: the decay, the update, the moments' quotient
    bound = MARGIN * roundings * unit_roundoff("float32") * float(init.abs().max())
    assert (out[True] - out[None]).abs().max() <= bound
