"""The Accelerator's loop at 2 processes against one process on the same global batch.

* Parity: an accelerate-style loop (``accumulate``, ``clip_grad_norm_``, a prepared StepLR)
  at 2 ranks x 4 samples against 1 rank x 8 samples, gradient accumulation 2, ZeRO stages
  0, 2 and 3: parameters (normwise, each tensor within ``per_tensor``) within
  ``trajectory(1e-2, steps)`` (``tests/tolerance.py``). fp32, no dropout; the only
  difference is the order of the sums (two half-batch means averaged by the reduction vs
  one mean), which AdamW's normalised update carries into the weights.
* Exact resume: stop after one optimizer step, ``save_state``, rebuild everything,
  ``load_state``, finish the epoch: parameters bit-identical to the uninterrupted run.
* ``gather_for_metrics`` on datasets of 13, 7 and 1 rows (batch 3 at 2 ranks: padded
  tails) returns every row exactly once, in dataset order; also for dicts and for lists
  of strings (``gather_object``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.harness import run_ranks
from tests.tolerance import check_weights, trajectory

N_ROWS = 48
GLOBAL_BATCH = 8
GAS = 2
STAGES = (0, 2, 3)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(N_ROWS, 8, generator=g), torch.randint(0, 4, (N_ROWS,), generator=g)
    )


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _setup(stage: int, world: int):
    from meshtrain import Accelerator

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    # seed=: the shuffle's generator seed fixed (meshtrain's argument), so that 1 and 2
    # processes deal the same global order; accelerate's default draws it from the global
    # RNG, per pass in one process and once at prepare in several, orders that differ
    acc = Accelerator(gradient_accumulation_steps=GAS, config={"zero_optimization": zero}, seed=0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # accelerate steps a prepared scheduler once per process per optimizer step
    # (split_batches=False), so world x 2 scheduler steps are 2 optimizer steps everywhere
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2 * world, gamma=0.5)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // world, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched


def _train(acc, model, opt, loader, sched, stop_after: int | None = None) -> int:
    model.train()
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
        if i + 1 == stop_after:  # before the loader yields (and counts) the next batch
            break
    return acc.engine.global_steps


def _params(acc) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in acc.get_state_dict().items()}


def _gather_checks(acc) -> dict:
    out = {}
    for n in (13, 7, 1):
        rows = torch.arange(n)
        loader = acc.prepare(DataLoader(TensorDataset(rows), batch_size=3))
        got, got_dict, got_obj = [], [], []
        for (x,) in loader:
            got.append(acc.gather_for_metrics(x))
            got_dict.append(acc.gather_for_metrics({"x": x * 2})["x"])
            got_obj.extend(acc.gather_for_metrics([f"r{int(v)}" for v in x]))
        out[n] = (torch.cat(got).tolist(), (torch.cat(got_dict) // 2).tolist(), got_obj)
    return out


def _run(state_dir: str = "") -> dict:
    world = torch.distributed.get_world_size()
    out = {}
    for stage in STAGES:
        acc, *objs = _setup(stage, world)
        out["steps", stage] = _train(acc, *objs)
        out["lr", stage] = objs[-1].get_last_lr()[0]
        out["params", stage] = _params(acc)
    if world > 1:
        stage = 2
        acc, *objs = _setup(stage, world)
        _train(acc, *objs, stop_after=GAS)  # one optimizer step
        acc.save_state(state_dir)
        acc, *objs = _setup(stage, world)
        acc.load_state(state_dir)
        _train(acc, *objs)
        out["resumed", stage] = _params(acc)
        out["gather"] = _gather_checks(acc)
        out["info"] = (acc.num_processes, acc.process_index, acc.is_main_process, str(acc.device))
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_ranks(_run, 2, str(tmp_path_factory.mktemp("state")))


def test_two_processes_match_one_and_resume_exactly(two):
    one = run_ranks(_run, 1)[0]
    for stage in STAGES:
        assert one["steps", stage] == two[0]["steps", stage] == N_ROWS // GLOBAL_BATCH // GAS
        assert one["lr", stage] == two[0]["lr", stage] == 1e-2 * 0.5
        bound = trajectory(1e-2, one["steps", stage])  # the peak rate every step
        for r in (0, 1):
            check_weights(
                f"stage {stage} rank {r}", two[r]["params", stage], one["params", stage], bound
            )
    for k, v in two[0]["params", 2].items():
        assert torch.equal(two[0]["resumed", 2][k], v), f"resume differs at {k}"
    assert [t["info"][:3] for t in two] == [(2, 0, True), (2, 1, False)]


def test_gather_for_metrics_returns_each_row_once(two):
    for n, (rows, rows_dict, objs) in two[0]["gather"].items():
        assert rows == list(range(n)), (n, rows)
        assert rows_dict == list(range(n))
        assert objs == [f"r{i}" for i in range(n)]
