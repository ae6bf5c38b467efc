"""Optimizers by name (issue 30) against their own implementations.

Protocol: "the same parameters and gradients". Every rank trains on the *same* rows, so
the data-parallel average of N identical gradients ((g + g) / 2) is g bit for bit and
every layout sees exactly the single-process gradients. Then:

* Lion (bitsandbytes Lion32bit) at one process: bit-identical; Adafactor
  (torch.optim.Adafactor) at one process: within ``trajectory(1e-2, 6)`` (losses relative,
  the state normwise and per tensor; ``tests/tolerance.py``: a normalised update like
  Adam's, whose rows/columns statistics may be summed in another order; measured:
  identical);
* Lion and AdamW8bit under ZeRO-2 on 2 ranks, AdamW8bit also under ZeRO 1, 3 and CPU
  offload: bit-identical to the library's optimizer stepping the model's parameters in
  one process. 8-bit state is blockwise (absmax per 256 elements); meshtrain's "blocks"
  master layout puts every parameter and every rank's chunk on the 256 grid and chooses
  8-bit state by the whole parameter's size, so a shard steps the same blocks;
* foreach AdamW equals torch's foreach AdamW bit for bit;
* (their checkpoints, which are not element-wise: tests/checkpoint/test_slice_state.py)
* Adafactor under ZeRO 1, 2 and 3 over 2 ranks: within the same bound of torch's
  Adafactor in one process. Its factored statistics need each parameter whole, so the "whole" master layout
  packs every parameter inside one rank's chunk (``zero.packing.pack_whole``); the reference
  tolerance is the one-process one (the same arithmetic per parameter, measured identical).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.training import global_batch, make_model
from tests.harness import run_ranks
from tests.tolerance import check, check_weights, trajectory

pytest.importorskip("bitsandbytes")

STEPS, BATCH = 6, 4
# min_8bit_size 256: the tiny decoder's matrices (>= 1536 elements) get 8-bit state, its
# norms (32) keep 32-bit state, so both paths run
CASES = {
    "AdamW8bit": ({"lr": 1e-2, "min_8bit_size": 256}, "AdamW8bit"),
    "Lion": ({"lr": 1e-3}, "Lion32bit"),
    "Adafactor": ({"lr": 1e-2, "beta2_decay": -0.7, "d": 1.0, "maximize": False}, None),
    "AdamW": ({"lr": 1e-2, "foreach": True}, None),
}


def _reference(name: str) -> tuple[list[float], dict]:
    import bitsandbytes as bnb

    params, bnb_class = CASES[name]
    torch.manual_seed(0)
    model = make_model("decoder")
    ps = list(model.parameters())
    if bnb_class is not None:
        opt = getattr(bnb.optim, bnb_class)(ps, **params)
    elif name == "Adafactor":
        opt = torch.optim.Adafactor(ps, **params, foreach=False)
    else:
        opt = torch.optim.AdamW(ps, lr=params["lr"], weight_decay=0.0, foreach=True)
    losses = []
    for step in range(STEPS):
        x, y = global_batch("decoder", step, BATCH)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(name: str, zero: dict | None) -> tuple[list[float], dict, object]:
    import meshtrain

    torch.manual_seed(0)
    model = make_model("decoder")
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": name, "params": CASES[name][0]},
        "steps_per_print": 1000,
        "zero_optimization": zero or {"stage": 0},
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    losses = []
    for step in range(STEPS):
        x, y = global_batch("decoder", step, BATCH)  # the same rows on every rank
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.module_state_dict(), engine.memory_report()


def _runs(layouts):
    import torch.distributed as dist

    from meshtrain.errors import ConfigError

    out = {}
    for name, zero in layouts:
        key = f"{name}/{zero}"
        try:
            losses, state, report = _engine(name, zero)
        except ConfigError as err:
            out[key] = ("refused", str(err))
            continue
        out[key] = (losses, state if dist.get_rank() == 0 else None, report)
    return out


def _same(got, ref, exact: bool) -> None:
    losses, state, _ = got
    ref_losses, ref_state = ref
    if exact:
        assert losses == ref_losses
        for k, v in ref_state.items():
            assert torch.equal(state[k], v), k
    else:  # Adafactor, the only one compared with a bound
        bound = trajectory(CASES["Adafactor"][0]["lr"], STEPS)
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            check(f"loss {step}", abs(a - b) / abs(b), bound)
        check_weights("Adafactor", state, ref_state, bound)


def test_each_optimizer_matches_its_library_at_one_process():
    layouts = [(name, None) for name in CASES]
    got = run_ranks(_runs, 1, layouts)[0]
    for name in CASES:
        _same(got[f"{name}/None"], _reference(name), exact=name != "Adafactor")
    # optimizer-state bytes: the formula's K (catalog) beside what the optimizer holds
    report = got["AdamW8bit/None"][2]
    assert report.optimizer == "AdamW8bit"
    assert report.formula is not None and report.measured.optimizer > 0


def test_sharded_runs_step_bit_identically_and_adafactor_whole_per_rank():
    off = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    layouts = [
        ("AdamW8bit", None),
        ("AdamW8bit", {"stage": 1}),
        ("AdamW8bit", {"stage": 2}),
        ("AdamW8bit", {"stage": 3, "stage3_param_persistence_threshold": 0}),
        ("AdamW8bit", off),
        ("Lion", {"stage": 2}),
        ("Adafactor", {"stage": 1}),
        ("Adafactor", {"stage": 2}),
        ("Adafactor", {"stage": 3, "stage3_param_persistence_threshold": 0}),
    ]
    got = run_ranks(_runs, 2, [*layouts, ("Adafactor", None)])[0]
    ref8, ref_lion = _reference("AdamW8bit"), _reference("Lion")
    for _, zero in layouts[:5]:
        _same(got[f"AdamW8bit/{zero}"], ref8, exact=True)
    _same(got[f"Lion/{ {'stage': 2} }"], ref_lion, exact=True)
    ref_factor = _reference("Adafactor")
    for _, zero in layouts[6:]:
        _same(got[f"Adafactor/{zero}"], ref_factor, exact=False)
    # each rank holds whole parameters and their factored state: about half of one process
    shard = got[f"Adafactor/{ {'stage': 2} }"][2].measured.optimizer
    assert 0 < shard < 0.75 * got["Adafactor/None"][2].measured.optimizer
    # ZeRO-2 over 2 ranks: each rank holds about half the 8-bit state of one process
    half = got[f"AdamW8bit/{ {'stage': 2} }"][2].measured.optimizer
    assert half < 0.6 * got["AdamW8bit/None"][2].measured.optimizer
