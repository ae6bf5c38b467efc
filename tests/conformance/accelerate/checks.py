"""accelerate's own test scripts, restated so that each check runs against either library.

Every ``check_*`` function takes ``impl`` (``"accelerate"`` or ``"meshtrain"``), builds an
Accelerator of that library (``accelerator(impl, ...)``; only the import differs) and
asserts what the peer test asserts. Its docstring names the peer test it restates
(file and function in huggingface/accelerate, ``src/accelerate/test_utils/scripts/``).
``run_all`` runs every check in one process group and reports each one's failure text,
so one spawned group of 2 ranks carries the whole suite for one library.

Tolerances: the restated tests use ``torch.allclose`` defaults (rtol 1e-5, atol 1e-8)
where the peer does; parameter parity after training is 1e-6 absolute on parameters of
order 1 (fp32, summation order). Derived (``tests/tolerance.py``): these models train with
SGD, which is not normalised, so a gradient's rounding in another order (one evaluation,
at most ``evaluation()`` = 1.9e-6 relative) moves a parameter by ``lr |g|`` times that per
step: under 2e-7 over these few steps at ``lr |g| <= 0.1``. Outputs and gradients of one
evaluation on values of order 1: the same 1e-6 absolute (``evaluation()`` relative).
"""

from __future__ import annotations

import io
import traceback
from contextlib import redirect_stdout
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

IMPLS = ("accelerate", "meshtrain")


def accelerator(impl: str, split_batches: bool = False, **kwargs):
    """A fresh Accelerator of ``impl`` (accelerate's singletons reset between checks).
    ``split_batches`` goes into a ``DataLoaderConfiguration`` (accelerate 1.15 ignores the
    constructor argument of that name)."""
    if split_batches:
        from accelerate.utils import DataLoaderConfiguration

        kwargs["dataloader_config"] = DataLoaderConfiguration(split_batches=True)
    if impl == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        from accelerate import Accelerator

        AcceleratorState._reset_state()
        GradientState._reset_state()
        return Accelerator(cpu=True, **kwargs)
    from meshtrain import Accelerator

    return Accelerator(**kwargs)


class RegressionDataset:
    """accelerate.test_utils.RegressionDataset: y = a x + b + noise, rows as dicts."""

    def __init__(self, a=2, b=3, length=64, seed=None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(nn.Module):
    """accelerate.test_utils.RegressionModel: ``x * a + b`` with scalar parameters."""

    def __init__(self, a=0.0, b=0.0):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a).float())
        self.b = nn.Parameter(torch.tensor(b).float())

    def forward(self, x=None):
        return x * self.a + self.b


def _step_model(model, x, y, acc, do_backward=True):
    model.train()
    out = model(x)
    loss = F.mse_loss(out, y.to(out.device))
    if not do_backward:
        loss /= acc.gradient_accumulation_steps
        loss.backward()
    else:
        acc.backward(loss)


def _setup(acc, sched=False, with_opt=False):
    """test_sync.get_training_setup: a reference model and its prepared copy."""
    torch.manual_seed(42)
    model = RegressionModel(1.0, 0.5)
    ddp_model = deepcopy(model)
    loader = DataLoader(RegressionDataset(length=80, seed=42), batch_size=16)
    model.to(acc.device)
    if sched or with_opt:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
        s = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda e: e**0.65)
        ddp_s = torch.optim.lr_scheduler.LambdaLR(ddp_opt, lr_lambda=lambda e: e**0.65)
        ddp_model, ddp_opt, ddp_s, loader = acc.prepare(ddp_model, ddp_opt, ddp_s, loader)
        return model, opt, s, loader, ddp_model, ddp_opt, ddp_s
    ddp_model, loader = acc.prepare(ddp_model, loader)
    return model, ddp_model, loader


def _grads_equal(model, ddp_model) -> list[bool]:
    return [
        bool(torch.allclose(p.grad, q.grad))
        for p, q in zip(model.parameters(), ddp_model.parameters(), strict=True)
        if p.requires_grad
    ]


# --- test_sync.py ------------------------------------------------------------------------------
def check_sync_no_sync(impl):
    """test_sync.py::test_distributed_sync: inside ``no_sync`` gradients stay local (differ
    from the full-batch model's), outside they are averaged (equal). Model prepared
    without an optimizer."""
    acc = accelerator(impl)
    model, ddp_model, loader = _setup(acc)
    batch = next(iter(loader))
    x, y = batch["x"], batch["y"]
    for it in range(3):
        gx, gy = acc.gather((x, y))
        _step_model(model, gx, gy, acc)
        if it % 2 == 0:
            with acc.no_sync(ddp_model):
                _step_model(ddp_model, x, y, acc)
        else:
            _step_model(ddp_model, x, y, acc)
        same = _grads_equal(model, ddp_model)
        assert all(not s for s in same) if it % 2 == 0 else all(same), (it, same)
        torch.manual_seed(1337 + it)
        perm = torch.randperm(len(x))
        x, y = x[perm], y[perm]


def _accumulate_grads(impl, with_opt: bool):
    acc = accelerator(impl, gradient_accumulation_steps=2)
    objs = _setup(acc, with_opt=with_opt)
    model, ddp_model, loader = (objs[0], objs[4], objs[3]) if with_opt else objs
    n = len(loader)
    for it, batch in enumerate(loader):
        x, y = batch["x"], batch["y"]
        gx, gy = acc.gather((x, y))
        _step_model(model, gx, gy, acc, False)
        with acc.accumulate(ddp_model):
            _step_model(ddp_model, x, y, acc)
        same = _grads_equal(model, ddp_model)
        if (it + 1) % 2 == 0 or it == n - 1:
            assert all(same), f"iteration {it}: gradients should be in sync"
        else:
            assert not any(same), f"iteration {it}: gradients should not be in sync"
    assert acc.step == 0


def check_sync_accumulate_gradients(impl):
    """test_sync.py::test_gradient_accumulation: under ``accumulate`` gradients are
    averaged at every 2nd micro-step and at the loader's end, local in between (model
    prepared without an optimizer)."""
    _accumulate_grads(impl, with_opt=False)


def check_sync_accumulate_gradients_engine(impl):
    """test_sync.py::test_gradient_accumulation with the optimizer prepared too (meshtrain:
    the model trains on an Engine's flat buffers; ``p.grad`` must still be local, then
    averaged)."""
    _accumulate_grads(impl, with_opt=True)


def _opt_steps(optimizer) -> int:
    """How often AdamW stepped (its per-parameter ``step`` count; the peer test reads
    ``_step_count``, which torch 2.14 no longer sets)."""
    states = [s for s in optimizer.state.values() if "step" in s]
    return int(states[0]["step"]) if states else 0


def check_sync_accumulate_opt_and_scheduler(impl):
    """test_sync.py::test_gradient_accumulation_with_opt_and_scheduler: the optimizer steps
    once per window (as often as the full-batch reference's) and the scheduler
    ``num_processes`` times as often."""
    acc = accelerator(impl, gradient_accumulation_steps=2)
    model, opt, sched, loader, ddp_model, ddp_opt, ddp_sched = _setup(acc, sched=True)
    n = len(loader)
    for it, batch in enumerate(loader):
        x, y = batch["x"], batch["y"]
        gx, gy = acc.gather((x, y))
        model.train()
        ddp_model.train()
        _step_model(model, gx, gy, acc, False)
        if (it + 1) % 2 == 0 or it == n - 1:
            opt.step()
            sched.step()
            opt.zero_grad()
        with acc.accumulate(ddp_model):
            _step_model(ddp_model, x, y, acc)
            ddp_opt.step()
            ddp_sched.step()
            ddp_opt.zero_grad()
        assert _opt_steps(ddp_opt.optimizer) == _opt_steps(opt), it
        assert ddp_sched.scheduler.last_epoch == sched.last_epoch * acc.num_processes, it
    assert acc.step == 0


# --- test_script.py ----------------------------------------------------------------------------
def check_process_execution_decorators(impl):
    """test_script.py::process_execution_check: ``on_main_process``,
    ``on_local_main_process``, ``on_last_process``, ``on_process(process_index=)`` run the
    function on the selected process only."""
    acc = accelerator(impl)
    ran = []

    @acc.on_main_process
    def main():
        ran.append("main")

    @acc.on_local_main_process
    def local_main():
        ran.append("local_main")

    @acc.on_last_process
    def last():
        ran.append("last")

    @acc.on_process(process_index=1 % acc.num_processes)
    def second():
        ran.append("second")

    for f in (main, local_main, last, second):
        f()
    want = []
    if acc.is_main_process:
        want.append("main")
    if acc.is_local_main_process:
        want.append("local_main")
    if acc.process_index == acc.num_processes - 1:
        want.append("last")
    if acc.process_index == 1 % acc.num_processes:
        want.append("second")
    assert ran == want, (ran, want)


def check_main_process_first(impl):
    """test_script.py::process_execution_check: inside ``main_process_first`` the main
    process's block has finished before any other process enters its own."""
    import os
    import tempfile

    acc = accelerator(impl)
    path = os.path.join(tempfile.gettempdir(), f"mpf_{impl}_{os.environ.get('MASTER_PORT')}")
    if acc.is_main_process and os.path.exists(path):
        os.remove(path)
    acc.wait_for_everyone()
    with acc.main_process_first():
        with open(path, "a") as f:
            f.write(f"{acc.process_index}\n")
    acc.wait_for_everyone()
    lines = Path(path).read_text().split()
    assert lines[0] == "0" and sorted(lines) == [str(i) for i in range(acc.num_processes)]
    acc.wait_for_everyone()


def check_split_between_processes_list(impl):
    """test_script.py::test_split_between_processes_list: a list of ``2 P + 1`` items is
    split into contiguous shares; with ``apply_padding`` all shares have equal length."""
    acc = accelerator(impl)
    data = list(range(0, 2 * acc.num_processes + 1))
    with acc.split_between_processes(data) as part:
        n = len(part)
        first = part[0]
    lens = acc.gather(torch.tensor([n]))
    assert int(lens.sum()) == len(data)
    assert first == (0 if acc.process_index == 0 else 3 + 2 * (acc.process_index - 1))
    with acc.split_between_processes(data, apply_padding=True) as part:
        assert len(part) == 3, part
        padded = acc.gather(torch.tensor(part))
    assert padded.tolist() == ([0, 1, 2, 3, 4, 4] if acc.num_processes == 2 else data)


def check_split_between_processes_dict(impl):
    """test_script.py::test_split_between_processes_nested_dict: every value of a dict is
    split the same way."""
    acc = accelerator(impl)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = ["a", "b", "c", "d", "e", "f", "g", "h"]
    c = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    data = {"a": a, "b": b, "c": c}
    with acc.split_between_processes(data) as part:
        if acc.num_processes == 1:
            assert part["a"] == a
        else:
            k = 8 // acc.num_processes
            i = acc.process_index
            assert part["a"] == a[i * k : (i + 1) * k]
            assert part["b"] == b[i * k : (i + 1) * k]
            assert torch.equal(part["c"], c[i * k : (i + 1) * k])


def check_split_between_processes_tensor(impl):
    """test_script.py::test_split_between_processes_tensor: a tensor is split along dim 0;
    an uneven split padded with ``apply_padding`` gathers to equal shapes."""
    acc = accelerator(impl)
    data = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    with acc.split_between_processes(data) as part:
        if acc.num_processes == 2:
            assert torch.equal(part, data[acc.process_index : acc.process_index + 1])
    data = torch.arange(5)
    with acc.split_between_processes(data, apply_padding=True) as part:
        got = acc.gather(part)
    if acc.num_processes == 2:
        assert got.tolist() == [0, 1, 2, 3, 4, 4], got


def check_dataloader_preparation(impl):
    """test_script.py::dl_preparation_check: gathering every batch of a prepared loader
    gives ``arange(length)`` in order (each process holds whole consecutive batches), with
    and without ``split_batches``; shuffled, every row exactly once."""
    for split in (False, True):
        acc = accelerator(impl, split_batches=split)
        length = 32 * acc.num_processes
        dl = acc.prepare(DataLoader(list(range(length)), batch_size=8))
        got = torch.cat([acc.gather(torch.as_tensor(b)) for b in dl])
        assert torch.equal(got.cpu(), torch.arange(length)), (split, got)
        assert len(dl) == (length // 8 if split else length // (8 * acc.num_processes))
    acc = accelerator(impl)
    dl = acc.prepare(DataLoader(list(range(length)), batch_size=8, shuffle=True))
    got = torch.cat([acc.gather(torch.as_tensor(b)) for b in dl])
    assert sorted(got.tolist()) == list(range(length))


def check_dataloader_batches_per_process(impl):
    """data_loader.BatchSamplerShard (tests/test_data_loader.py::test_batch_sampler_shards_*,
    restated at 2 processes through ``prepare``): 21 rows, batch 4. Process ``r`` gets
    batches ``r, r + 2, ...``; the last global batch is completed with the first rows
    (``even_batches``); ``drop_last`` leaves the incomplete global batch out;
    ``split_batches`` gives each process its half of every batch of 8."""
    acc = accelerator(impl)
    if acc.num_processes != 2:
        return
    rows = list(range(21))
    expected = {
        "plain": [
            [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]],
            [[4, 5, 6, 7], [12, 13, 14, 15], [20, 0, 1, 2]],
        ],
        "drop_last": [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]],
        "split": [
            [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]],
            [[4, 5, 6, 7], [12, 13, 14, 15], [20, 0, 1, 2]],
        ],
    }
    cases = {
        "plain": (accelerator(impl), DataLoader(rows, batch_size=4)),
        "drop_last": (accelerator(impl), DataLoader(rows, batch_size=4, drop_last=True)),
        "split": (accelerator(impl, split_batches=True), DataLoader(rows, batch_size=8)),
    }
    for name, (acc, loader) in cases.items():
        dl = acc.prepare(loader)
        got = [torch.as_tensor(b).tolist() for b in dl]
        assert got == expected[name][acc.process_index], (name, got)
        assert len(dl) == len(expected[name][0]), (name, len(dl))
        if name == "plain":  # gather_for_metrics drops the 3 repeated rows
            kept = torch.cat([acc.gather_for_metrics(torch.as_tensor(b)) for b in dl])
            assert kept.tolist() == rows, kept


def check_dataloader_shuffled_order(impl):
    """prepare_data_loader with ``shuffle=True`` (use_seedable_sampler=False, the default):
    the loader's RandomSampler gets a generator seeded from the main process's global RNG
    at ``prepare``; each epoch is that sampler's next pass, dealt in whole batches. With
    ``torch.manual_seed(123)`` before ``prepare`` the batches are exactly these, two epochs
    (the expected order is computed with torch's own RandomSampler)."""
    from torch.utils.data import RandomSampler

    n, bs = 20, 3
    torch.manual_seed(123)
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    g = torch.Generator()
    g.manual_seed(seed)
    acc = accelerator(impl)
    world, rank = acc.num_processes, acc.process_index
    torch.manual_seed(123)
    dl = acc.prepare(DataLoader(list(range(n)), batch_size=bs, shuffle=True))
    for epoch in range(2):
        perm = list(RandomSampler(range(n), generator=g))
        total = -(-n // (bs * world)) * bs * world
        stream = perm + perm[: total - n]
        want = [
            stream[(k * world + rank) * bs : (k * world + rank + 1) * bs]
            for k in range(total // (bs * world))
        ]
        got = [torch.as_tensor(b).tolist() for b in dl]
        assert got == want, (epoch, got, want)


def check_training_parity(impl):
    """test_script.py::training_check: a model trained through prepare() (model, optimizer
    and loader in one call) ends where the one-process loop over the same data does
    (within 1e-6)."""
    acc = accelerator(impl)
    n, bs = 64, 8
    torch.manual_seed(0)
    ref = RegressionModel(1.0, 0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    full = DataLoader(RegressionDataset(length=n, seed=42), batch_size=bs * acc.num_processes)
    for _ in range(2):
        for batch in full:
            ref_opt.zero_grad()
            F.mse_loss(ref(batch["x"]), batch["y"]).backward()
            ref_opt.step()
    model = RegressionModel(1.0, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(RegressionDataset(length=n, seed=42), batch_size=bs)
    model, opt, dl = acc.prepare(model, opt, dl)
    for _ in range(2):
        for batch in dl:
            opt.zero_grad()
            acc.backward(F.mse_loss(model(batch["x"]), batch["y"]))
            opt.step()
    got = acc.unwrap_model(model)
    assert abs(float(got.a) - float(ref.a)) < 1e-6, (float(got.a), float(ref.a))
    assert abs(float(got.b) - float(ref.b)) < 1e-6, (float(got.b), float(ref.b))


def check_trigger(impl):
    """test_script.py::test_trigger: ``set_trigger`` on one process is seen by
    ``check_trigger`` on every process, and is cleared after."""
    acc = accelerator(impl)
    assert acc.check_trigger() is False
    if acc.process_index == acc.num_processes - 1:
        acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False


def check_state_properties(impl):
    """test_script.py::main's state checks: process counts and indices, main/last
    process, the device."""
    acc = accelerator(impl)
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    assert acc.num_processes == world and acc.process_index == rank
    assert acc.is_main_process == (rank == 0)
    assert acc.is_last_process == (rank == world - 1)
    assert acc.local_process_index == rank and acc.is_local_main_process == (rank == 0)
    assert acc.device.type == "cpu"
    assert acc.use_distributed == (world > 1)
    assert str(acc.distributed_type).endswith("MULTI_CPU" if world > 1 else "NO")


def check_print_on_local_main_only(impl):
    """test_script.py::print_on(accelerator.print): prints on the local main process only."""
    acc = accelerator(impl)
    buf = io.StringIO()
    with redirect_stdout(buf):
        acc.print("hello")
    assert buf.getvalue() == ("hello\n" if acc.is_local_main_process else "")


# --- test_ops.py -------------------------------------------------------------------------------
def _ranked(acc):
    return torch.arange(3.0) + 3 * acc.process_index


def check_ops_gather(impl):
    """test_ops.py::test_gather: every rank's tensor concatenated in rank order."""
    acc = accelerator(impl)
    got = acc.gather(_ranked(acc))
    assert got.tolist() == list(np.arange(3.0 * acc.num_processes)), got


def check_ops_gather_nested(impl):
    """test_ops.py::test_gather (nested): a dict/tuple of tensors is gathered leaf by leaf,
    and a non-contiguous tensor too (test_gather_non_contigous)."""
    acc = accelerator(impl)
    t = _ranked(acc)
    got = acc.gather({"a": t, "b": (t * 2,)})
    assert got["a"].tolist() == list(np.arange(3.0 * acc.num_processes))
    assert got["b"][0].tolist() == [2 * v for v in got["a"].tolist()]
    nc = torch.arange(6.0).reshape(2, 3).t()[:, :1] + acc.process_index  # non-contiguous
    assert acc.gather(nc).shape == (3 * acc.num_processes, 1)


def check_ops_gather_object(impl):
    """test_ops.py::test_gather_object: a list of Python objects per rank, concatenated."""
    acc = accelerator(impl)
    if impl == "accelerate":
        from accelerate.utils import gather_object as peer_gather_object

        got = peer_gather_object([acc.process_index])
    else:
        got = acc.gather_for_metrics([acc.process_index], use_gather_object=True)
    assert got == list(range(acc.num_processes)), got


def check_ops_pad_across_processes(impl):
    """test_ops.py::test_pad_across_processes: the shorter rank's tensor is padded with
    zeros to the longest length; ``pad_first`` pads at the front."""
    acc = accelerator(impl)
    t = torch.arange(1, 2 + acc.process_index, dtype=torch.float32)  # lengths 1, 2, ...
    got = acc.pad_across_processes(t)
    assert got.shape[0] == acc.num_processes
    assert got[: len(t)].tolist() == t.tolist() and got[len(t) :].eq(0).all()
    first = acc.pad_across_processes(t, pad_first=True, pad_index=-1)
    assert first[-len(t) :].tolist() == t.tolist() and first[: -len(t)].eq(-1).all()


def check_ops_reduce_sum(impl):
    """test_ops.py::test_reduce_sum: element-wise sum over the ranks."""
    acc = accelerator(impl)
    got = acc.reduce(torch.tensor([1.0, 2.0]) * (acc.process_index + 1), "sum")
    k = sum(range(1, acc.num_processes + 1))
    assert got.tolist() == [k, 2 * k], got


def check_ops_reduce_mean(impl):
    """test_ops.py::test_reduce_mean: element-wise mean over the ranks."""
    acc = accelerator(impl)
    got = acc.reduce(torch.tensor([1.0, 2.0]) * (acc.process_index + 1), "mean")
    k = sum(range(1, acc.num_processes + 1)) / acc.num_processes
    assert torch.allclose(got, torch.tensor([k, 2 * k])), got


# --- external_deps/test_metrics.py ---------------------------------------------------------------
def _metrics_run(acc, n: int, bs: int):
    torch.manual_seed(0)
    model = nn.Linear(1, 2)
    ref = model(torch.arange(float(n)).unsqueeze(1)).detach()
    ddp_model = acc.prepare(deepcopy(model))
    dl = acc.prepare(DataLoader(torch.arange(float(n)).unsqueeze(1), batch_size=bs))
    logits = []
    with torch.no_grad():
        for x in dl:
            logits.append(acc.gather_for_metrics(ddp_model(x)))
    return ref, torch.cat(logits)


def check_metrics_gather_for_metrics_uneven(impl):
    """test_metrics.py::test_torch_metrics: ``gather_for_metrics`` over a loader whose
    length does not divide evenly returns exactly the dataset's rows, in order, equal to
    one process's outputs (an evaluation model prepared without an optimizer)."""
    acc = accelerator(impl)
    for n in (82, 13):
        ref, got = _metrics_run(acc, n, 16)
        assert got.shape == ref.shape, (n, got.shape)
        assert torch.allclose(got, ref, atol=1e-6), n


def check_metrics_gather_for_metrics_objects(impl):
    """test_metrics.py::test_gather_for_metrics_with_non_tensor_objects: lists of strings
    come back once per row."""
    acc = accelerator(impl)
    dl = acc.prepare(DataLoader([f"s{i}" for i in range(7)], batch_size=2))
    got = []
    for batch in dl:
        got.extend(acc.gather_for_metrics(list(batch)))
    assert sorted(got) == sorted(f"s{i}" for i in range(7)), got


# --- external_deps/test_checkpointing.py ---------------------------------------------------------
def check_checkpointing_save_load_state(impl):
    """test_checkpointing.py::test_can_resume_training (restated): ``save_state`` then
    more training, then ``load_state`` restores model, optimizer and scheduler; training
    on from there repeats the same parameters."""
    import os
    import tempfile

    acc = accelerator(impl)
    torch.manual_seed(0)
    model = RegressionModel(1.0, 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    dl = DataLoader(RegressionDataset(length=32, seed=1), batch_size=4)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)

    def epoch():
        for batch in dl:
            opt.zero_grad()
            acc.backward(F.mse_loss(model(batch["x"]), batch["y"]))
            opt.step()
            sched.step()
        net = acc.unwrap_model(model)
        return (net.a.item(), net.b.item(), sched.get_last_lr()[0])

    epoch()
    tag = os.environ.get("MASTER_PORT", "0")
    path = os.path.join(tempfile.gettempdir(), f"conformance_ckpt_{impl}_{tag}")
    acc.save_state(path)
    after_save = epoch()
    acc.load_state(path)
    net = acc.unwrap_model(model)
    again = epoch()
    assert abs(again[0] - after_save[0]) < 1e-6 and abs(again[1] - after_save[1]) < 1e-6, (
        again,
        after_save,
    )
    assert abs(again[2] - after_save[2]) < 1e-12
    assert isinstance(net, RegressionModel)


# --- the Accelerator's documented behaviour (accelerator.md), as the scripts use it --------------
def check_prepare_separate_calls(impl):
    """accelerate docs (``prepare`` takes any objects in any order): a model prepared in
    one call and its optimizer in another trains like one call (test_script.py's
    training_check, split over calls)."""
    acc = accelerator(impl)
    torch.manual_seed(0)
    model = RegressionModel(1.0, 0.5)
    ref = deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dl = acc.prepare(DataLoader(RegressionDataset(length=32, seed=3), batch_size=4))
    model = acc.prepare(model)
    opt = acc.prepare(opt)
    for batch in dl:
        gx, gy = acc.gather((batch["x"], batch["y"]))
        ref_opt.zero_grad()
        F.mse_loss(ref(gx), gy).backward()
        ref_opt.step()
        opt.zero_grad()
        acc.backward(F.mse_loss(model(batch["x"]), batch["y"]))
        opt.step()
    got = acc.unwrap_model(model)
    assert abs(float(got.a) - float(ref.a)) < 1e-6 and abs(float(got.b) - float(ref.b)) < 1e-6


def check_prepare_two_models(impl):
    """accelerate docs (several models, e.g. a GAN or teacher/student): two models and two
    optimizers prepared together train like two plain models on the gathered batch."""
    acc = accelerator(impl)
    torch.manual_seed(0)
    g, d = nn.Linear(2, 2), nn.Linear(2, 1)
    rg, rd = deepcopy(g), deepcopy(d)
    og, od = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (g, d))
    rog, rod = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (rg, rd))
    x = torch.randn(4 * acc.num_processes, 2, generator=torch.Generator().manual_seed(5))
    mine = x[4 * acc.process_index : 4 * acc.process_index + 4]
    g, d, og, od = acc.prepare(g, d, og, od)
    for _ in range(3):
        for opt, ref_opt, key in ((od, rod, "d"), (og, rog, "g")):
            ref_opt.zero_grad()
            if key == "d":
                (rd(rg(x).detach()) ** 2).mean().backward()
            else:
                (-rd(rg(x))).mean().backward()
            ref_opt.step()
            opt.zero_grad()
            if key == "d":
                acc.backward((d(g(mine).detach()) ** 2).mean())
            else:
                acc.backward((-d(g(mine))).mean())
            opt.step()
    for m, r in ((g, rg), (d, rd)):
        for p, q in zip(acc.unwrap_model(m).parameters(), r.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-6), (p, q)


def check_prepare_eval_only_model(impl):
    """accelerate docs: ``model, eval_loader = accelerator.prepare(model, eval_loader)``
    for inference: outputs equal the plain model's."""
    acc = accelerator(impl)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ref = deepcopy(model)
    data = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    pm, dl = acc.prepare(model, DataLoader(data, batch_size=2))
    pm.eval()
    with torch.no_grad():
        out = torch.cat([acc.gather_for_metrics(pm(b)) for b in dl])
        assert torch.allclose(out, ref(data), atol=1e-6)
    assert acc.unwrap_model(pm) is model


def check_prepare_passes_other_objects(impl):
    """accelerate docs: ``prepare`` returns objects it does not know unchanged, in order."""
    acc = accelerator(impl)
    thing = {"not": "preparable"}
    dl, same = acc.prepare(DataLoader(list(range(4)), batch_size=2), thing)
    assert same is thing


def check_backward_divides_by_accumulation(impl):
    """accelerator.backward: the loss is divided by ``gradient_accumulation_steps``
    (outside ``accumulate`` every backward synchronises)."""
    acc = accelerator(impl, gradient_accumulation_steps=4)
    model = RegressionModel(1.0, 0.0)
    ref = deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.full((2,), float(acc.process_index + 1))
    acc.backward((model(x) ** 2).sum())
    gx = acc.gather(x)
    ((ref(gx) ** 2).sum() / 4 / acc.num_processes).backward()
    for p, q in zip(acc.unwrap_model(model).parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad), (p.grad, q.grad)


def check_clip_grad_norm_in_place(impl):
    """accelerator.clip_grad_norm_: at a synchronising step it returns the global norm of
    the averaged gradients before clipping and leaves them clipped in place."""
    acc = accelerator(impl)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(2 * acc.num_processes, 4, generator=torch.Generator().manual_seed(1))
    mine = x[2 * acc.process_index : 2 * acc.process_index + 2]
    acc.backward(model(mine).pow(2).sum() * 10)
    (ref(x).pow(2).sum() * 10 / acc.num_processes).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    norm = acc.clip_grad_norm_(model.parameters(), 0.5)
    assert abs(float(norm) - float(want)) <= 1e-5 * float(want), (norm, want)
    for p, q in zip(acc.unwrap_model(model).parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), (p.grad, q.grad)


def check_grad_kept_after_step_until_zero_grad(impl):
    """AcceleratedOptimizer.step over DDP (test_sync.py's loops read ``p.grad`` around the
    step): ``optimizer.step()`` leaves ``p.grad`` as it was (the averaged gradient,
    clipped by ``clip_grad_norm_``); a backward without ``zero_grad()`` adds the next
    averaged gradient to it; ``zero_grad()`` sets it to None (1e-6)."""
    acc = accelerator(impl)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    net = acc.unwrap_model(model)
    g = torch.Generator().manual_seed(1)
    lo = 2 * acc.process_index
    for step in range(2):
        x = torch.randn(2 * acc.num_processes, 4, generator=g)
        acc.backward(model(x[lo : lo + 2]).pow(2).sum())
        (ref(x).pow(2).sum() / acc.num_processes).backward()
        if step == 0:
            acc.clip_grad_norm_(model.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_opt.step()  # no zero_grad after the first step: the second backward adds
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None, step
            assert torch.allclose(p.grad, q.grad, atol=1e-6), (step, p.grad, q.grad)
            assert torch.allclose(p, q, atol=1e-6), (step, p, q)
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def check_optimizer_noop_off_boundary(impl):
    """AcceleratedOptimizer.step / zero_grad: inside an accumulation window both are
    no-ops (the parameters do not move and the gradients are kept)."""
    acc = accelerator(impl, gradient_accumulation_steps=2)
    model = RegressionModel(1.0, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    net = acc.unwrap_model(model)
    with acc.accumulate(model):
        acc.backward((model(torch.ones(2)) ** 2).sum())
        before = [p.detach().clone() for p in net.parameters()]
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad()
        assert acc.sync_gradients is False
        assert all(torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters(), strict=True))
    with acc.accumulate(model):
        acc.backward((model(torch.ones(2)) ** 2).sum())
        opt.step()
        assert acc.sync_gradients is True
        assert not all(torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))


def check_autocast_fp32_noop(impl):
    """accelerator.autocast: in fp32 the block computes in fp32."""
    acc = accelerator(impl)
    with acc.autocast():
        y = nn.Linear(2, 2)(torch.ones(1, 2))
    assert y.dtype == torch.float32


CHECKS = {
    name[len("check_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")
}


def run_all(impl: str, names: list[str] | None = None) -> dict[str, str | None]:
    """Run the checks (all by default) in this process group; each one's failure text."""
    import logging

    logging.getLogger("meshtrain").setLevel(logging.ERROR)
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
