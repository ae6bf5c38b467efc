"""Optimizers and LR schedules built from the DeepSpeed config (meshtrain.optim.optimizers).

Optimizer steps are compared bit-exactly with torch's own optimizer built by hand with the
same hyper-parameters and the same implementation (single-tensor on CPU, torch's own CPU
default): same algorithm, same kernels, same order of operations, so any difference is a
wrong mapping, not rounding. They are also compared bit-exactly with torch's ``foreach``
implementation, which meshtrain used on CPU before: the element-wise arithmetic is the same,
so switching costs no bit of reproducibility.

Schedules are compared with the formulas in their docstrings (to 1e-12 relative: the test's
formula is written independently, so the float operation order may differ) and, when
DeepSpeed is installed, with DeepSpeed's own classes *exactly* (same operation order).
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.errors import ConfigError
from meshtrain.optim.lr_schedules import (
    SUPPORTED_SCHEDULERS,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)
from meshtrain.optim.optimizers import SUPPORTED_OPTIMIZERS, build_optimizer
from tests.tolerance import evaluation

# --------------------------------------------------------------------------- helpers


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]


def _clone(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_(True) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 5) -> None:
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _assert_same_run(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, a, b) -> None:
    _run(ours, a)
    _run(ref, b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()
    for x, y in zip(a, b, strict=True):
        sx, sy = ours.state[x], ref.state[y]
        assert sx.keys() == sy.keys()
        for k in sx:
            assert torch.equal(torch.as_tensor(sx[k]), torch.as_tensor(sy[k])), k


# --------------------------------------------------------------------------- optimizers

_HP_ADAM = {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
_HP_ADAM_T = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}

OPTIMIZER_CASES = [
    # (DeepSpeed type, DeepSpeed params, torch class, torch kwargs)
    ("Adam", _HP_ADAM, torch.optim.AdamW, _HP_ADAM_T),
    ("Adam", {**_HP_ADAM, "adam_w_mode": True}, torch.optim.AdamW, _HP_ADAM_T),
    ("Adam", {**_HP_ADAM, "adam_w_mode": False}, torch.optim.Adam, _HP_ADAM_T),
    (
        "adam",
        {**_HP_ADAM, "torch_adam": True, "bias_correction": True},
        torch.optim.AdamW,
        _HP_ADAM_T,
    ),
    ("Adam", {**_HP_ADAM, "amsgrad": True}, torch.optim.AdamW, {**_HP_ADAM_T, "amsgrad": True}),
    ("AdamW", _HP_ADAM, torch.optim.AdamW, _HP_ADAM_T),
    # DeepSpeed: type AdamW is AdamW whatever adam_w_mode says
    ("ADAMW", {**_HP_ADAM, "adam_w_mode": False}, torch.optim.AdamW, _HP_ADAM_T),
    (
        "SGD",
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    (
        "sgd",
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1},
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1},
    ),
    (
        "Adagrad",
        {
            "lr": 0.05,
            "lr_decay": 0.01,
            "weight_decay": 0.01,
            "initial_accumulator_value": 0.1,
            "eps": 1e-9,
        },
        torch.optim.Adagrad,
        {
            "lr": 0.05,
            "lr_decay": 0.01,
            "weight_decay": 0.01,
            "initial_accumulator_value": 0.1,
            "eps": 1e-9,
        },
    ),
]


@pytest.mark.parametrize(("opt_type", "ds_params", "ref_cls", "ref_kwargs"), OPTIMIZER_CASES)
def test_optimizer_steps_like_torch_reference(opt_type, ds_params, ref_cls, ref_kwargs):
    base = _params()
    a, b = _clone(base), _clone(base)
    ours = build_optimizer(opt_type, dict(ds_params), [{"params": a}])
    assert type(ours) is ref_cls
    assert ours.defaults["foreach"] is False  # CPU: single-tensor, torch's CPU default
    ref = ref_cls([{"params": b}], foreach=False, **ref_kwargs)
    for k, v in ref_kwargs.items():
        assert ours.param_groups[0][k] == v, k
    _assert_same_run(ours, ref, a, b)
    c, d = _clone(base), _clone(base)  # and torch's foreach implementation, bit for bit
    ours = build_optimizer(opt_type, dict(ds_params), [{"params": c}])
    _assert_same_run(ours, ref_cls([{"params": d}], foreach=True, **ref_kwargs), c, d)


def test_defaults_are_deepspeeds():
    # FusedAdam's defaults for Adam and AdamW (torch's AdamW would use weight_decay 0.01)
    for t in ("Adam", "AdamW"):
        g = build_optimizer(t, {}, [{"params": _clone(_params())}]).param_groups[0]
        assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["amsgrad"]) == (
            1e-3,
            (0.9, 0.999),
            1e-8,
            0.0,
            False,
        )
    g = build_optimizer("SGD", {}, [{"params": _clone(_params())}]).param_groups[0]
    assert (g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"]) == (
        1e-3,
        0,
        0,
        0,
        False,
    )
    g = build_optimizer("Adagrad", {}, [{"params": _clone(_params())}]).param_groups[0]
    assert (
        g["lr"],
        g["lr_decay"],
        g["weight_decay"],
        g["initial_accumulator_value"],
        g["eps"],
    ) == (1e-2, 0, 0, 0, 1e-10)


def test_adam_defaults_match_deepspeed_fused_adam_signature():
    fused_adam = pytest.importorskip("deepspeed.ops.adam.fused_adam", exc_type=ImportError)
    sig = inspect.signature(fused_adam.FusedAdam.__init__).parameters
    g = build_optimizer("Adam", {}, [{"params": _clone(_params())}]).param_groups[0]
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert g[name] == sig[name].default, name
    assert sig["adam_w_mode"].default is True


def test_adam_semantics_decoupled_vs_l2():
    """With a zero gradient AdamW only shrinks p by (1 - lr*wd); Adam-L2 feeds wd*p through
    the moments, so its first step moves every element by ~lr (m/sqrt(v) = sign(p))."""
    lr, wd = 0.1, 0.5
    p0 = torch.tensor([2.0, -3.0, 0.5])
    for mode, expected in ((True, p0 * (1 - lr * wd)), (False, p0 - lr * torch.sign(p0))):
        p = p0.clone().requires_grad_(True)
        opt = build_optimizer(
            "Adam", {"lr": lr, "weight_decay": wd, "adam_w_mode": mode}, [{"params": [p]}]
        )
        p.grad = torch.zeros_like(p)
        opt.step()
        # a few fp32 roundings of values of order 1 (Adam-L2's step is sign(p) only up to
        # eps / |wd p| ~ 1e-8): one evaluation (tests/tolerance.py)
        torch.testing.assert_close(p.detach(), expected, rtol=evaluation(), atol=evaluation())


def test_group_overrides_win_and_inputs_are_not_modified():
    base = _params()
    a, b = _clone(base), _clone(base)
    groups = [
        {"params": [a[0]]},
        {"params": [a[1]], "weight_decay": 0.0, "lr": 3e-3, "betas": [0.5, 0.6]},
    ]
    ours = build_optimizer("Adam", {"lr": 1e-2, "weight_decay": 0.1}, groups)
    assert groups[1]["betas"] == [0.5, 0.6]  # caller's dicts untouched
    g0, g1 = ours.param_groups
    assert (g0["lr"], g0["weight_decay"], g0["betas"]) == (1e-2, 0.1, (0.9, 0.999))
    assert (g1["lr"], g1["weight_decay"], g1["betas"]) == (3e-3, 0.0, (0.5, 0.6))
    ref = torch.optim.AdamW(
        [
            {"params": [b[0]]},
            {"params": [b[1]], "weight_decay": 0.0, "lr": 3e-3, "betas": (0.5, 0.6)},
        ],
        lr=1e-2,
        weight_decay=0.1,
        betas=(0.9, 0.999),
        eps=1e-8,
        foreach=True,
    )
    _assert_same_run(ours, ref, a, b)


def test_cuda_device_type_selects_fused_where_torch_has_it():
    # torch's fused Adam/AdamW/SGD kernels also run on CPU tensors, so this builds here.
    for t in ("Adam", "AdamW", "SGD"):
        opt = build_optimizer(t, {}, [{"params": _clone(_params())}], device_type="cuda")
        assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    opt = build_optimizer("Adagrad", {}, [{"params": _clone(_params())}], device_type="cuda")
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("opt_type", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_cuda_optimizer_matches_cpu_reference(opt_type):
    """Fused CUDA kernels vs CPU foreach: fp32, different kernels -> ~1e-6 relative."""
    base = _params()
    a = [p.cuda().requires_grad_(True) for p in base]
    b = _clone(base)
    hp = {"lr": 1e-2, "weight_decay": 0.01}
    ours = build_optimizer(opt_type, hp, [{"params": a}], device_type="cuda")
    ref = build_optimizer(opt_type, hp, [{"params": b}])
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        for x, y in zip(a, b, strict=True):
            y.grad = torch.randn(y.shape, generator=g)
            x.grad = y.grad.cuda()
        ours.step()
        ref.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.detach().cpu(), y.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("opt_type", "params", "needles"),
    [
        (
            "Adam",
            {"learning_rate": 1e-3},
            ["optimizer.params.learning_rate", "lr", "betas", "adam_w_mode"],
        ),
        ("SGD", {"betas": [0.9, 0.9]}, ["optimizer.params.betas", "momentum", "nesterov"]),
        ("Adagrad", {"momentum": 0.9}, ["optimizer.params.momentum", "lr_decay"]),
        ("Adam", {"max_grad_norm": 1.0}, ["optimizer.params.max_grad_norm", "gradient_clipping"]),
        ("Lamb", {}, ["optimizer.type", "'Lamb'", "Adam, AdamW, SGD, Adagrad"]),
        ("Adam", {"lr": -1.0}, ["optimizer.params", "Invalid learning rate"]),
        ("Adam", {"eps": "tiny"}, ["optimizer.params", "'tiny'"]),
        ("Adam", {"betas": [0.9]}, ["optimizer.params.betas", "two numbers"]),
        ("Adam", {"bias_correction": False}, ["optimizer.params.bias_correction"]),
        ("SGD", {"nesterov": True}, ["optimizer.params", "Nesterov"]),
    ],
)
def test_bad_optimizer_config_raises_config_error_with_path(opt_type, params, needles):
    with pytest.raises(ConfigError) as info:
        build_optimizer(opt_type, params, [{"params": _clone(_params())}])
    for needle in needles:
        assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


# --------------------------------------------------------------------------- schedules
# Hand-written formulas (the class docstrings), t = last_batch_iteration.


def _warm(t: int, w: int, kind: str) -> float:
    w = max(2, w)
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


def ref_warmup(t, lo=0.0, hi=1e-3, w=1000, kind="log"):
    if t < 0:
        return lo
    return lo + (hi - lo) * (_warm(t, w, kind) if t < max(2, w) else 1.0)


def ref_decay(t, total, lo=0.0, hi=1e-3, w=1000, kind="log"):
    if t < 0:
        return lo
    w2 = max(2, w)
    gamma = _warm(t, w, kind) if t < w2 else max(0.0, (total - t) / max(1, total - w2))
    return lo + (hi - lo) * gamma


def ref_cosine(t, base, total, m=0.0, w=1000, c=1e-4, kind="log"):
    if t < 0:
        return 0.0
    w2 = max(2, w)
    if t < w2:
        return base * (m + (1 - m) * _warm(t, w, kind))
    p = min(1.0, (t - w2 + 1) / max(1, total - w2))
    return base * max(0.0, c + (1 - c) * (1 + math.cos(math.pi * p)) / 2)


def _opt(lr: float = 0.01, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=lr
    )


def trace(sched, opt, steps: int = 30) -> list[list[float]]:
    """The optimizer's lrs before the first step() and after each of `steps` steps."""
    out = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
        assert sched.get_last_lr() == out[-1]
    return out


SCHEDULE_CASES = [
    # (type, params, optimizer lr, reference lr(t))
    ("WarmupLR", {}, 0.01, lambda t: ref_warmup(t, hi=0.01)),
    (
        "WarmupLR",
        {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
        0.5,
        lambda t: ref_warmup(t, 1e-4, 1e-2, 10),
    ),
    (
        "WarmupLR",
        {
            "warmup_min_lr": 1e-4,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
        },
        0.5,
        lambda t: ref_warmup(t, 1e-4, 1e-2, 10, "linear"),
    ),
    (
        "WarmupLR",
        {"warmup_num_steps": 1, "warmup_type": "linear"},
        0.3,
        lambda t: ref_warmup(t, 0, 0.3, 1, "linear"),
    ),
    ("WarmupDecayLR", {"total_num_steps": 100}, 0.5, lambda t: ref_decay(t, 100)),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 20,
            "warmup_min_lr": 1e-4,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 5,
        },
        0.5,
        lambda t: ref_decay(t, 20, 1e-4, 1e-2, 5),
    ),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 20,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
        },
        0.5,
        lambda t: ref_decay(t, 20, 0.0, 1e-2, 5, "linear"),
    ),
    (
        "WarmupDecayLR",
        {"total_num_steps": 3, "warmup_num_steps": 8},
        0.5,
        lambda t: ref_decay(t, 3, w=8),
    ),
    ("WarmupCosineLR", {"total_num_steps": 100}, 0.02, lambda t: ref_cosine(t, 0.02, 100)),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 20,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 5,
            "cos_min_ratio": 0.01,
        },
        0.02,
        lambda t: ref_cosine(t, 0.02, 20, 0.1, 5, 0.01),
    ),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 20,
            "warmup_num_steps": 5,
            "cos_min_ratio": 0.0,
            "warmup_type": "linear",
        },
        0.02,
        lambda t: ref_cosine(t, 0.02, 20, 0.0, 5, 0.0, "linear"),
    ),
    (
        "WarmupCosineLR",
        {"total_num_steps": 4, "warmup_num_steps": 10},
        0.02,
        lambda t: ref_cosine(t, 0.02, 4, w=10),
    ),
]


@pytest.mark.parametrize(("sched_type", "params", "lr", "ref"), SCHEDULE_CASES)
def test_schedule_matches_written_formula(sched_type, params, lr, ref):
    opt = _opt(lr)
    sched = build_scheduler(sched_type, dict(params), opt)
    got = trace(sched, opt)
    # got[k] is the lr after k step() calls, i.e. at t = k - 1
    assert [x[0] for x in got] == pytest.approx(
        [ref(k - 1) for k in range(len(got))], rel=1e-12, abs=1e-15
    )


def test_step_zero_behaviour_literal_values():
    """What the optimizer holds before the first step, spelled out (DeepSpeed 0.19 behaviour):
    WarmupLR/WarmupDecayLR set warmup_min_lr at construction and step() #1 (t=0) keeps it;
    WarmupCosineLR sets 0.0 at construction and base*warmup_min_ratio after step() #1."""
    opt = _opt(0.5)
    got = [
        x[0]
        for x in trace(
            build_scheduler(
                "WarmupLR",
                {"warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": "linear"},
                opt,
            ),
            opt,
            13,
        )
    ]
    assert got == pytest.approx(
        [0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0]
    )

    opt = _opt(0.5)
    params = {
        "total_num_steps": 8,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1.0,
        "warmup_num_steps": 4,
        "warmup_type": "linear",
    }
    got = [x[0] for x in trace(build_scheduler("WarmupDecayLR", params, opt), opt, 11)]
    assert got == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])

    opt = _opt(1.0)
    params = {
        "total_num_steps": 8,
        "warmup_min_ratio": 0.2,
        "warmup_num_steps": 4,
        "cos_min_ratio": 0.0,
        "warmup_type": "linear",
    }
    got = [x[0] for x in trace(build_scheduler("WarmupCosineLR", params, opt), opt, 10)]
    # warmup: 0.2 + 0.8 * t/4; cosine starts at p = 1/4, never at exactly 1.0
    c = [(1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3, 4)]
    assert got == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, *c, 0.0, 0.0])

    opt = _opt(0.5)
    got = [
        x[0]
        for x in trace(
            build_scheduler(
                "WarmupLR",
                {"warmup_min_lr": 0.01, "warmup_max_lr": 1.0, "warmup_num_steps": 10},
                opt,
            ),
            opt,
            10,
        )
    ]
    assert got[0] == got[1] == 0.01  # log warmup: ln(1) = 0 at t = 0
    assert got[10] == pytest.approx(1.0)  # t = 9 = W - 1: ln(10)/ln(10)


def test_per_group_lists_and_defaults_from_optimizer():
    opt = _opt(0.25, groups=2)
    sched = build_scheduler(
        "WarmupLR",
        {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 0.2], "warmup_num_steps": 4},
        opt,
    )
    got = trace(sched, opt, 8)
    assert [x[0] for x in got] == pytest.approx([ref_warmup(k - 1, 0.0, 1.0, 4) for k in range(9)])
    assert [x[1] for x in got] == pytest.approx([ref_warmup(k - 1, 0.1, 0.2, 4) for k in range(9)])

    opt = _opt(0.25)
    assert build_scheduler("WarmupLR", {"warmup_num_steps": 2}, opt).max_lrs == [
        0.25
    ]  # DeepSpeed >= 0.1x
    opt = _opt(0.25)
    assert build_scheduler("WarmupDecayLR", {"total_num_steps": 9}, opt).max_lrs == [0.001]


def test_tensor_lr_and_duck_typed_optimizer():
    class Wrapper:  # e.g. a ZeRO wrapper exposing its inner optimizer's param_groups
        def __init__(self):
            self.param_groups = [{"lr": torch.tensor(0.5)}]

    opt = Wrapper()
    lr_tensor = opt.param_groups[0]["lr"]
    sched = build_scheduler(
        "WarmupCosineLR",
        {"total_num_steps": 10, "warmup_num_steps": 2, "warmup_min_ratio": 0.5},
        opt,
    )
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == 0.0
    sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == 0.25
    assert sched.get_last_lr() == [0.25]
    assert opt.param_groups[0]["initial_lr"] == 0.5  # a float, not an alias of the tensor


@pytest.mark.parametrize(("sched_type", "params", "lr", "ref"), SCHEDULE_CASES)
def test_state_dict_round_trip_resumes_the_same_sequence(sched_type, params, lr, ref):
    opt = _opt(lr)
    sched = build_scheduler(sched_type, dict(params), opt)
    full = trace(sched, opt, 30)

    for cut in (0, 1, 7, 12):
        opt = _opt(lr)
        sched = build_scheduler(sched_type, dict(params), opt)
        trace(sched, opt, cut)
        state = json.loads(json.dumps(sched.state_dict()))
        assert state == {"last_batch_iteration": cut - 1}
        opt_state = opt.state_dict()

        # engine order: fresh optimizer + schedule, then load both states
        opt2 = _opt(lr)
        sched2 = build_scheduler(sched_type, dict(params), opt2)
        sched2.load_state_dict(state)
        opt2.load_state_dict(opt_state)
        assert sched2.get_last_lr() == full[cut]
        assert trace(sched2, opt2, 30 - cut) == full[cut:]

        # restored optimizer state first, schedule built at last_step afterwards
        opt3 = _opt(lr)
        opt3.load_state_dict(opt_state)
        sched3 = build_scheduler(
            sched_type, dict(params), opt3, last_step=state["last_batch_iteration"]
        )
        assert [g["lr"] for g in opt3.param_groups] == full[cut]
        assert trace(sched3, opt3, 30 - cut) == full[cut:]


@pytest.mark.parametrize(
    ("sched_type", "params", "needles"),
    [
        (
            "OneCycle",
            {},
            ["scheduler.type", "'OneCycle'", "WarmupLR, WarmupDecayLR, WarmupCosineLR"],
        ),
        (
            "WarmupLR",
            {"warmup_ratio": 0.1},
            ["scheduler.params.warmup_ratio", "warmup_min_lr", "warmup_type"],
        ),
        ("WarmupLR", {"total_num_steps": 10}, ["scheduler.params.total_num_steps", "WarmupLR"]),
        (
            "WarmupCosineLR",
            {"warmup_min_lr": 0.0, "total_num_steps": 10},
            ["scheduler.params.warmup_min_lr", "cos_min_ratio"],
        ),
        ("WarmupDecayLR", {}, ["scheduler.params.total_num_steps", "required"]),
        (
            "WarmupCosineLR",
            {"warmup_num_steps": 5},
            ["scheduler.params.total_num_steps", "required"],
        ),
        (
            "WarmupDecayLR",
            {"total_num_steps": 0},
            ["scheduler.params.total_num_steps", "positive integer"],
        ),
        (
            "WarmupLR",
            {"warmup_type": "cosine"},
            ["scheduler.params.warmup_type", "'cosine'", "linear"],
        ),
        (
            "WarmupLR",
            {"warmup_num_steps": -1},
            ["scheduler.params.warmup_num_steps", "integer >= 0"],
        ),
        ("WarmupLR", {"warmup_num_steps": "ten"}, ["scheduler.params.warmup_num_steps"]),
        (
            "WarmupLR",
            {"warmup_min_lr": [0.0, 0.1]},
            ["scheduler.params.warmup_min_lr", "list of 1"],
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 9, "cos_min_ratio": "low"},
            ["scheduler.params.cos_min_ratio", "number"],
        ),
    ],
)
def test_bad_scheduler_config_raises_config_error_with_path(sched_type, params, needles):
    with pytest.raises(ConfigError) as info:
        build_scheduler(sched_type, params, _opt())
    for needle in needles:
        assert needle in str(info.value)


def test_integral_float_step_counts_and_case_insensitive_names():
    opt = _opt()
    sched = build_scheduler(
        "warmupdecaylr", {"total_num_steps": 1e2, "warmup_num_steps": 10.0}, opt
    )
    assert isinstance(sched, WarmupDecayLR)
    assert (sched.total_num_steps, sched.warmup_num_steps) == (100, 10)
    assert type(sched.total_num_steps) is int


def test_supported_names_and_import_has_no_heavy_side_effects():
    assert SUPPORTED_OPTIMIZERS == (
        "Adam",
        "AdamW",
        "SGD",
        "Adagrad",
        "Adafactor",
        "AdamW8bit",
        "Lion",
        "Lion8bit",
    )
    assert SUPPORTED_SCHEDULERS == ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
    assert {WarmupLR, WarmupDecayLR, WarmupCosineLR}
    code = (
        "import sys, meshtrain.optim.optimizers, meshtrain.optim.lr_schedules\n"
        "heavy = [m for m in ('deepspeed', 'transformers', 'fastapi', 'bitsandbytes', 'meshtrain.engine.engine') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- vs DeepSpeed


def _ds_schedules():
    return pytest.importorskip("deepspeed.runtime.lr_schedules", exc_type=ImportError)


def _compare_with_deepspeed(sched_type, params, lr, groups=1, steps=30):
    ds = _ds_schedules()
    opt_ds, opt_ours = _opt(lr, groups), _opt(lr, groups)
    theirs = getattr(ds, sched_type)(opt_ds, **params)
    ours = build_scheduler(sched_type, dict(params), opt_ours)
    assert trace(ours, opt_ours, steps) == trace(theirs, opt_ds, steps)  # exact
    assert ours.state_dict() == theirs.state_dict()


@pytest.mark.parametrize(("sched_type", "params", "lr", "ref"), SCHEDULE_CASES)
def test_schedule_matches_deepspeed_exactly(sched_type, params, lr, ref):
    _compare_with_deepspeed(sched_type, params, lr)


def test_per_group_lists_match_deepspeed_exactly():
    params = {"warmup_min_lr": [0.0, 1e-4], "warmup_max_lr": [1e-2, 3e-3], "warmup_num_steps": 7}
    _compare_with_deepspeed("WarmupLR", params, 0.1, groups=2)
    _compare_with_deepspeed("WarmupDecayLR", {**params, "total_num_steps": 20}, 0.1, groups=2)


@settings(max_examples=60, deadline=None)
@given(
    sched_type=st.sampled_from(SUPPORTED_SCHEDULERS),
    warmup=st.integers(1, 40),
    total=st.integers(1, 60),
    kind=st.sampled_from(["log", "linear"]),
    lo=st.floats(0, 1e-3),
    hi=st.floats(1e-4, 1e-1),
    ratio=st.floats(0, 0.5),
)
def test_random_schedules_match_deepspeed_exactly(sched_type, warmup, total, kind, lo, hi, ratio):
    params: dict = {"warmup_num_steps": warmup, "warmup_type": kind}
    if sched_type == "WarmupCosineLR":
        params |= {"total_num_steps": total, "warmup_min_ratio": ratio, "cos_min_ratio": ratio / 10}
    else:
        params |= {"warmup_min_lr": lo, "warmup_max_lr": hi}
        if sched_type == "WarmupDecayLR":
            params["total_num_steps"] = total
    _compare_with_deepspeed(sched_type, params, 0.01, steps=70)
