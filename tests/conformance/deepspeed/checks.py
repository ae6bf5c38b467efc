"""DeepSpeed's engine-API and loss-scaler unit tests, restated to run against either library.

``check_*`` functions take ``impl`` (``"deepspeed"`` or ``"meshtrain"``); only the
``initialize`` they call differs. Each docstring names the DeepSpeed test it restates
(deepspeedai/DeepSpeed, ``tests/unit/...``). DeepSpeed runs on CPU here
(``DS_ACCELERATOR=cpu``, gloo) with client optimizers (``torch.optim``), which need no
compiled op. The loss-scaler checks drive DeepSpeed's ``DynamicLossScaler`` and
meshtrain's ``LossScaler`` with the same overflow sequences: DeepSpeed's fp16 optimizer is
not available on CPU, and the scaler is where the rule lives (meshtrain's engine calls
``scaler.update(overflow)`` once per optimizer step, as DeepSpeed's optimizer calls
``update_scale``).

Tolerances: parameters after training within 1e-6 absolute (fp32, summation order), on
parameters of order 1. Derived (``tests/tolerance.py``): these models train with SGD, which
is not normalised, so a gradient's rounding in another order (one evaluation, at most
``evaluation()`` = 1.9e-6 relative) moves a parameter by ``lr |g|`` times that per step:
under 2e-7 over these few steps. Gradients of one evaluation: the same 1e-6 absolute on
values of order 1.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

import torch
from torch import nn

IMPLS = ("deepspeed", "meshtrain")
HIDDEN = 4


def initialize(impl: str, **kwargs):
    if impl == "deepspeed":
        import deepspeed

        return deepspeed.initialize(**kwargs)
    import meshtrain

    return meshtrain.initialize(**kwargs)


class SimpleModel(nn.Module):
    """DeepSpeed's tests/unit/simple_model.py::SimpleModel: linear layers and a
    cross-entropy loss, ``forward(x, y)``."""

    def __init__(self, hidden_dim=HIDDEN):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(2)])
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return self.loss(x, y)


class BatchModel(nn.Module):
    """A model whose ``forward`` takes one batch object (DeepSpeed passes it whole)."""

    def __init__(self):
        super().__init__()
        self.inner = SimpleModel()
        self.seen = None

    def forward(self, batch):
        self.seen = type(batch).__name__
        if isinstance(batch, dict):
            return self.inner(batch["x"], batch["y"])
        return self.inner(*batch)


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, **extra}


def _engine(impl, model=None, lr=0.1, scheduler=False, **extra):
    torch.manual_seed(0)
    model = model or SimpleModel()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    engine, optimizer, _, lr_scheduler = initialize(
        impl, model=model, optimizer=opt, lr_scheduler=sched, config=_config(**extra)
    )
    return engine, optimizer, lr_scheduler


def _batch(step: int, rank: int | None = None, n: int = 2):
    g = torch.Generator().manual_seed(100 + step)
    world = torch.distributed.get_world_size()
    x = torch.randn(n * world, HIDDEN, generator=g)
    y = torch.randint(0, HIDDEN, (n * world,), generator=g)
    if rank is None:
        return x, y
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _rank() -> int:
    return torch.distributed.get_rank()


# --- engine call semantics (runtime/test_ds_initialize.py, simple_model's data loop) ------------
def check_forward_passes_a_dict_whole(impl):
    """DeepSpeedEngine.forward(*inputs, **kwargs) -> module(*inputs, **kwargs): a dict given
    as ``engine(batch)`` reaches a one-argument forward as the dict (the loop of
    tests/unit/runtime/test_ds_initialize.py with a batch-object model)."""
    engine, *_ = _engine(impl, model=BatchModel())
    x, y = _batch(0, _rank())
    loss = engine({"x": x, "y": y})
    assert engine.module.seen == "dict" and loss.dim() == 0


def check_forward_passes_a_tuple_whole(impl):
    """DeepSpeedEngine.forward: ``engine((x, y))`` calls ``module((x, y))``."""
    engine, *_ = _engine(impl, model=BatchModel())
    loss = engine(_batch(0, _rank()))
    assert engine.module.seen == "tuple" and loss.dim() == 0


def check_forward_positional_and_keywords(impl):
    """DeepSpeedEngine.forward: ``engine(x, y)`` and ``engine(x=x, y=y)`` are the module's
    call (test_ds_initialize.py's ``model(batch[0], batch[1])``)."""
    engine, *_ = _engine(impl)
    x, y = _batch(0, _rank())
    want = engine.module(x, y)
    assert torch.allclose(engine(x, y), want) and torch.allclose(engine(x=x, y=y), want)


# --- initialize's return values (runtime/test_ds_initialize.py) --------------------------------------
def check_client_optimizer_is_stepped(impl):
    """test_ds_initialize.py::TestClientOptimizer: a client ``torch.optim`` optimizer is
    returned and stepping the engine moves the parameters."""
    engine, optimizer, _ = _engine(impl)
    assert optimizer is not None
    before = [p.detach().clone() for p in engine.module.parameters()]
    x, y = _batch(0, _rank())
    engine.backward(engine(x, y))
    engine.step()
    assert any(
        not torch.equal(b, p) for b, p in zip(before, engine.module.parameters(), strict=True)
    )


def check_client_lr_scheduler_stepped_by_engine(impl):
    """test_ds_initialize.py::TestClientLrScheduler: the client scheduler comes back and
    the engine steps it once per optimizer step (``get_lr``)."""
    engine, _, sched = _engine(impl, scheduler=True, gradient_accumulation_steps=2)
    assert sched is not None
    lrs = []
    for step in range(4):
        x, y = _batch(step, _rank())
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs == [0.1, 0.05, 0.05, 0.025], lrs


def check_model_and_module(impl):
    """test_ds_initialize.py: ``engine.module`` is the user's model; ``train()`` /
    ``eval()`` switch its mode."""
    model = SimpleModel()
    engine, *_ = _engine(impl, model=model)
    assert engine.module is model
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training


# --- batch-size arithmetic (runtime/test_ds_config_dict.py::TestBatchConfig) -------------------------
def check_batch_size_queries(impl):
    """test_ds_config_dict.py::TestBatchConfig: train_batch_size = micro x accumulation x
    data-parallel size, and the queries say so."""
    engine, *_ = _engine(impl, gradient_accumulation_steps=3)
    world = torch.distributed.get_world_size()
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 3
    assert engine.train_batch_size() == 2 * 3 * world


def check_ranks_and_precision_queries(impl):
    """test_ds_initialize.py / engine queries: ranks, world sizes, ZeRO stage and the
    precision flags of an fp32 engine."""
    engine, *_ = _engine(impl)
    assert engine.global_rank == _rank()
    assert engine.world_size == torch.distributed.get_world_size() == engine.dp_world_size
    assert engine.zero_optimization_stage() == 0
    assert engine.fp16_enabled() is False and engine.bfloat16_enabled() is False


# --- the step (runtime/test_runtime_utils.py, test_ds_config's accumulation) --------------------------
def check_accumulation_boundary_sequence(impl):
    """DeepSpeedEngine.is_gradient_accumulation_boundary: with 2 accumulation steps the
    micro-steps alternate False, True; parameters move on the boundary only, and
    ``global_steps`` counts optimizer steps."""
    engine, *_ = _engine(impl, gradient_accumulation_steps=2)
    seq, moved = [], []
    for step in range(4):
        before = [p.detach().clone() for p in engine.module.parameters()]
        seq.append(engine.is_gradient_accumulation_boundary())
        x, y = _batch(step, _rank())
        engine.backward(engine(x, y))
        engine.step()
        moved.append(
            any(
                not torch.equal(b, p)
                for b, p in zip(before, engine.module.parameters(), strict=True)
            )
        )
    assert seq == [False, True, False, True], seq
    assert moved == [False, True, False, True], moved
    assert engine.global_steps == 2


def _reference(steps: int, gas: int, clip: float = 0.0):
    torch.manual_seed(0)
    model = SimpleModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        (model(x, y) / gas).backward()
        if (step + 1) % gas == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model


def _per_rank_mean_loss(engine, x, y):
    # every rank's micro-batch loss is a mean over its rows; averaging the gradients over
    # the ranks gives the mean over the global batch, the reference's loss
    return engine(x, y)


def check_data_parallel_matches_one_process(impl):
    """test_ds_initialize.py's training loop at 2 ranks with accumulation 2 ends where one
    process on the global batch does (gradients averaged over ranks; 1e-6)."""
    engine, *_ = _engine(impl, gradient_accumulation_steps=2)
    for step in range(4):
        x, y = _batch(step, _rank())
        engine.backward(_per_rank_mean_loss(engine, x, y))
        engine.step()
    ref = _reference(4, 2)
    for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()


def check_gradient_clipping(impl):
    """``gradient_clipping`` in the config clips the global norm before the step (the
    reference: ``torch.nn.utils.clip_grad_norm_`` on the averaged gradient; 1e-6)."""
    engine, *_ = _engine(impl, gradient_clipping=0.05)
    for step in range(3):
        x, y = _batch(step, _rank())
        engine.backward(engine(x, y))
        engine.step()
    ref = _reference(3, 1, clip=0.05)
    for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()


# --- the gradients a script sees (DeepSpeedEngine.backward's allreduce_gradients; ----------------
# --- deepspeed.utils.safe_get_full_grad, tests/unit/runtime/zero/test_zero_tensor_fragment.py) ----
def _reference_grads(micro_steps: int) -> list[torch.Tensor]:
    """One process, the global batches of ``micro_steps`` micro-steps, loss / micro_steps."""
    torch.manual_seed(0)
    model = SimpleModel()
    for step in range(micro_steps):
        x, y = _batch(step)
        (model(x, y) / micro_steps).backward()
    return [p.grad for p in model.parameters()]


def _boundary_backward(impl, stage: int, gas: int = 2):
    engine, *_ = _engine(
        impl,
        gradient_accumulation_steps=gas,
        zero_optimization={"stage": stage},
        zero_allow_untested_optimizer=True,
    )
    for step in range(gas):
        x, y = _batch(step, _rank())
        engine.backward(engine(x, y))
        if step < gas - 1:
            engine.step()
    return engine


def check_grad_averaged_after_boundary_backward(impl):
    """DeepSpeedEngine.backward at the accumulation boundary (ZeRO stage 0) all-reduces and
    averages the gradients in place (``allreduce_gradients``): ``p.grad`` is the gradient
    of one process on the global batch (1e-6); after ``step()`` it is None."""
    engine = _boundary_backward(impl, 0)
    for p, want in zip(engine.module.parameters(), _reference_grads(2), strict=True):
        assert p.grad is not None and torch.allclose(p.grad, want, atol=1e-6), p.grad
    engine.step()
    assert all(p.grad is None for p in engine.module.parameters())


def _check_full_grad(impl, stage: int) -> None:
    if impl == "deepspeed":
        from deepspeed.utils import safe_get_full_grad
    else:
        from meshtrain.utils import safe_get_full_grad
    engine = _boundary_backward(impl, stage)
    params = list(engine.module.parameters())
    assert all(p.grad is None for p in params), [p.grad is None for p in params]
    for p, want in zip(params, _reference_grads(2), strict=True):
        full = safe_get_full_grad(p)  # a collective: every rank, every parameter
        assert full.dtype == torch.float32 and full.shape == want.shape
        assert torch.allclose(full, want, atol=1e-6), (full - want).abs().max()
    engine.step()
    assert all(p.grad is None for p in params)


def check_safe_get_full_grad_zero1(impl):
    """deepspeed.utils.safe_get_full_grad at ZeRO stage 1 (test_zero_tensor_fragment.py's
    use, after the boundary backward): ``p.grad`` is None (each rank holds only its slice
    of the reduced gradient) and the function assembles the averaged fp32 gradient, equal
    to one process's on the global batch (1e-6)."""
    _check_full_grad(impl, 1)


def check_safe_get_full_grad_zero2(impl):
    """deepspeed.utils.safe_get_full_grad at ZeRO stage 2: as at stage 1 (1e-6)."""
    _check_full_grad(impl, 2)


def check_safe_get_full_grad_zero3(impl):
    """deepspeed.utils.safe_get_full_grad at ZeRO stage 3 (parameters sharded too): as at
    stage 1, from the parameter's shards (1e-6)."""
    _check_full_grad(impl, 3)


# --- checkpoints (checkpoint/test_other_optimizer.py / test_latest_checkpoint.py) --------------------
def _ckpt_dir(impl: str, name: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"ds_conf_{impl}_{name}_{os.environ['MASTER_PORT']}")


def check_checkpoint_roundtrip_with_client_state(impl):
    """checkpoint/test_other_optimizer.py / common.checkpoint_correctness_verification:
    save_checkpoint(dir, tag, client_state) then load_checkpoint(dir, tag) restores the
    weights and returns ``(path, client_state)``; ``latest`` names the tag."""
    engine, *_ = _engine(impl)
    x, y = _batch(0, _rank())
    engine.backward(engine(x, y))
    engine.step()
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    d = _ckpt_dir(impl, "rt")
    engine.save_checkpoint(d, tag="t1", client_state={"epoch": 7})
    engine.backward(engine(*_batch(1, _rank())))
    engine.step()
    path, client = engine.load_checkpoint(d)
    assert path is not None and client["epoch"] == 7, (path, client)
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert Path(d, "latest").read_text().strip() == "t1"


def check_load_checkpoint_missing_dir(impl):
    """checkpoint/test_latest_checkpoint.py::test_missing_latest: loading from a directory
    with nothing in it returns ``(None, None)`` instead of raising."""
    engine, *_ = _engine(impl)
    d = _ckpt_dir(impl, "missing")
    os.makedirs(d, exist_ok=True)
    assert engine.load_checkpoint(d) == (None, None)


def check_save_16bit_model(impl):
    """checkpoint/test_zero_optimizer.py (save_16bit_model): the whole model's weights in the
    training dtype (fp32 here) written to ``save_dir/pytorch_model.bin``, loadable with
    ``torch.load``; every rank calls it."""
    engine, *_ = _engine(impl)
    d = _ckpt_dir(impl, "16bit")
    assert engine.save_16bit_model(d) in (True, None)
    torch.distributed.barrier()
    state = torch.load(os.path.join(d, "pytorch_model.bin"), weights_only=True)
    want = engine.module.state_dict()
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k].float(), want[k].float()) for k in want)


def check_was_step_applied(impl):
    """DeepSpeedEngine.was_step_applied: True after a boundary step that updated the
    parameters (fp32 never skips)."""
    engine, *_ = _engine(impl)
    engine.backward(engine(*_batch(0, _rank())))
    engine.step()
    assert engine.was_step_applied() is True


# --- DynamicLossScaler (runtime/half_precision/test_dynamic_loss_scale.py) ---------------------------
class _Scaler:
    """The same calls on DeepSpeed's ``DynamicLossScaler`` and meshtrain's ``LossScaler``."""

    def __init__(
        self, impl, power, window, hysteresis=2, min_scale=1.0, consecutive=False, raises=False
    ):
        self.impl = impl
        if impl == "deepspeed":
            from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

            flag = {} if raises else {"raise_error_at_min_scale": False}  # default: raise
            self.s = DynamicLossScaler(
                init_scale=2.0**power,
                scale_window=window,
                min_scale=min_scale,
                delayed_shift=hysteresis,
                consecutive_hysteresis=consecutive,
                **flag,
            )
        elif raises:  # meshtrain's defaults, as the engine builds them from an fp16 config
            from meshtrain.precision import LossScaler

            self.s = LossScaler(
                initial_scale_power=power,
                loss_scale_window=window,
                hysteresis=hysteresis,
                min_loss_scale=min_scale,
                consecutive_hysteresis=consecutive,
            )
        else:
            from meshtrain.precision import LossScaler

            self.s = LossScaler(
                initial_scale_power=power,
                loss_scale_window=window,
                hysteresis=hysteresis,
                min_loss_scale=min_scale,
                consecutive_hysteresis=consecutive,
                raise_error_at_min_scale=False,
                max_overflow_steps_at_min=10**6,
            )

    def update(self, overflow: bool) -> None:
        if self.impl == "deepspeed":
            self.s.update_scale(overflow)
        else:
            self.s.update(overflow)

    @property
    def scale(self) -> float:
        return self.s.cur_scale if self.impl == "deepspeed" else self.s.scale

    @property
    def iteration(self) -> int:
        return self.s.cur_iter if self.impl == "deepspeed" else self.s.steps

    @property
    def hysteresis(self) -> int:
        return self.s.cur_hysteresis if self.impl == "deepspeed" else self.s.hysteresis_left


def check_scaler_no_overflow(impl):
    """test_dynamic_loss_scale.py::TestFused::test_no_overflow: initial_scale_power 8,
    window 2: the scale doubles after every 2 clean steps, counted as DeepSpeed counts."""
    s = _Scaler(impl, 8, 2)
    expected = 2**8
    for i in range(10):
        s.update(False)
        assert s.scale == expected and s.iteration == i + 1, (i, s.scale, expected)
        if s.iteration % 2 == 0:
            expected *= 2


def check_scaler_all_overflow(impl):
    """test_dynamic_loss_scale.py::TestFused::test_all_overflow: hysteresis 1: every
    overflow halves the scale, never below min_loss_scale."""
    s = _Scaler(impl, 4, 2, hysteresis=1)
    expected = 2**4
    for i in range(8):
        s.update(True)
        expected = max(expected / 2, 1)
        assert s.scale == expected and s.iteration == i + 1, (i, s.scale)


def check_scaler_some_overflow(impl):
    """test_dynamic_loss_scale.py::TestFused::test_some_overflow: two overflows halve
    twice, window + 1 clean steps double once, one more overflow halves."""
    s = _Scaler(impl, 8, 2, hysteresis=1)
    for _ in range(2):
        s.update(True)
    assert s.scale == 2**6
    for _ in range(3):
        s.update(False)
    assert s.scale == 2**7 and s.iteration == 5
    s.update(True)
    assert s.scale == 2**6 and s.iteration == 6


def check_scaler_min_loss_scale(impl):
    """test_dynamic_loss_scale.py::TestUnfused::test_all_overflow: with min_loss_scale 2
    the scale stops at 2."""
    s = _Scaler(impl, 4, 2, hysteresis=1, min_scale=2.0)
    expected = 2**4
    for _ in range(8):
        s.update(True)
        expected = max(expected / 2, 2.0)
        assert s.scale == expected


def check_scaler_hysteresis(impl):
    """test_dynamic_loss_scale.py::TestZeroStage0Hysteresis::test_hysteresis: hysteresis 3
    absorbs 2 overflows, then each overflow halves."""
    s = _Scaler(impl, 8, 1000, hysteresis=3)
    scales = []
    for _ in range(4):
        s.update(True)
        scales.append(s.scale)
    assert scales == [2**8, 2**8, 2**7, 2**6], scales


def check_scaler_consecutive_hysteresis(impl):
    """test_dynamic_loss_scale.py::TestZeroStage0Hysteresis::test_consecutive_hysteresis: a
    clean step refills the hysteresis, so isolated overflows never lower the scale."""
    s = _Scaler(impl, 8, 1000, hysteresis=2, consecutive=True)
    for _ in range(4):
        s.update(True)
        s.update(False)
    assert s.scale == 2**8


def check_scaler_hysteresis_restored_on_growth(impl):
    """DynamicLossScaler.update_scale: without consecutive hysteresis, the hysteresis spent
    on an overflow comes back when the scale grows after a clean window."""
    s = _Scaler(impl, 8, 2, hysteresis=2)
    s.update(True)
    assert s.hysteresis == 1 and s.scale == 2**8
    for _ in range(3):
        s.update(False)
    assert s.hysteresis == 2 and s.scale == 2**9, (s.hysteresis, s.scale)


def check_scaler_raises_at_min_scale(impl):
    """DynamicLossScaler.update_scale with its default ``raise_error_at_min_scale=True`` (what
    every DeepSpeed fp16 engine builds): an overflow that would lower the scale when it is
    already at min_loss_scale raises at once, "Current loss scale already at minimum -
    cannot decrease scale anymore. Exiting run."; hysteresis left at the minimum is used
    up first; the scale and step count stay where they were."""
    # (power, hysteresis, overflows that do not raise): 4 -> 2 -> 1, then the third raises;
    # starting at the minimum with hysteresis 2, the first overflow spends it, the second raises
    for power, hysteresis, overflows_before in ((2, 1, 2), (0, 2, 1)):
        s = _Scaler(impl, power, 1000, hysteresis=hysteresis, min_scale=1.0, raises=True)
        for _ in range(overflows_before):
            s.update(True)
        assert s.scale == 1.0 and s.iteration == overflows_before, (s.scale, s.iteration)
        assert s.hysteresis == 1, s.hysteresis
        try:
            s.update(True)
        except Exception as exc:  # noqa: BLE001 - the peer's own message is what is checked
            assert str(exc).startswith(
                "Current loss scale already at minimum - cannot decrease scale anymore. "
                "Exiting run."
            ), str(exc)
        else:
            raise AssertionError("no error at the minimum loss scale")
        assert s.scale == 1.0 and s.iteration == overflows_before


CHECKS = {n[len("check_") :]: f for n, f in sorted(globals().items()) if n.startswith("check_")}


def run_all(impl: str, names: list[str] | None = None) -> dict[str, str | None]:
    import logging

    for name in ("meshtrain", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    out = {}
    for name in names or list(CHECKS):
        try:
            CHECKS[name](impl)
            out[name] = None
        except Exception:  # noqa: BLE001 - reported per check, so one failure hides no other
            out[name] = traceback.format_exc()
        torch.distributed.barrier()
    return out


__all__ = ["CHECKS", "IMPLS", "run_all"]
