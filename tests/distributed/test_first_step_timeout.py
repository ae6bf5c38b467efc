"""``distributed.first_step_timeout_minutes`` on real gloo ranks, through the Engine.

The group starts with the first-step timeout and the Engine's first finished step brings
every group (and the ledger's watchdog) to the steady ``distributed.timeout_minutes``
(``meshtrain.distributed.timeouts``). Two ranks, a steady timeout of STEADY_S and a
first-step one FIRST_S: rank 1 sleeps 2 x STEADY_S before its first backward (a node still
loading), which must not fail the job; after the first step it sleeps 3 x STEADY_S (a hang),
and rank 0's next collective must fail on the steady timeout. What is asserted is exact:
the timeout each group holds before and after the first step, and gloo's own word for the
bound it waited ("Timed out waiting <ms>ms"); no wall clock.
"""

from __future__ import annotations

import time

import pytest

from meshtrain.launch.processes import run_on_ranks

STEADY_S = 3.0
FIRST_S = 60.0


def _job(first_s: float | None) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    import meshtrain
    from meshtrain.distributed.store_io import pg_timeout_seconds

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "distributed": {
            "backend": "gloo",
            "timeout_minutes": STEADY_S / 60,
            "first_step_timeout_minutes": None if first_s is None else first_s / 60,
        },
    }
    torch.manual_seed(0)
    engine, *_ = meshtrain.initialize(model=nn.Linear(4, 1), config=config)
    rank = dist.get_rank()
    out = {"created_s": pg_timeout_seconds()}
    x = torch.ones(2, 4)

    def one_step() -> str | None:
        try:
            loss = engine(x).sum()
            engine.backward(loss)
            engine.step()
        except Exception as exc:  # noqa: BLE001 - the timeout is what is looked at
            return str(exc)
        return None

    if rank == 1:
        time.sleep(2 * STEADY_S)  # still "loading": longer than the steady timeout
    out["first_error"] = one_step()
    out["after_first_s"] = pg_timeout_seconds()
    out["ledger_s"] = engine.topology.stats.ledger.summary()["timeout_s"]
    if out["first_error"] is None:
        if rank == 1:
            time.sleep(3 * STEADY_S)  # a hang after the first step
        else:
            out["error"] = one_step()
    # the timed-out group cannot meet in the harness's closing barrier: each leaves alone
    dist.destroy_process_group()
    return out


def test_slow_first_step_survives_and_later_hang_is_caught() -> None:
    rank0, rank1 = run_on_ranks(_job, 2, (FIRST_S,), timeout=240.0, setup_distributed=False)
    for r in (rank0, rank1):
        assert r["first_error"] is None, r["first_error"]
        assert r["created_s"] == FIRST_S
        assert r["after_first_s"] == STEADY_S
        assert r["ledger_s"] == STEADY_S
    assert rank0["error"] is not None, "the hang after the first step was not caught"
    assert f"Timed out waiting {int(STEADY_S * 1000)}ms" in rank0["error"], rank0["error"]


def test_without_it_the_same_slow_first_step_is_killed() -> None:
    """The control: the same late rank with no first-step timeout fails the first step on
    the steady bound, so the test above shows the field at work, not a lenient sleep."""
    rank0, _ = run_on_ranks(_job, 2, (None,), timeout=240.0, setup_distributed=False)
    assert rank0["created_s"] == STEADY_S
    assert rank0["first_error"] is not None, "the late rank was not caught"
    assert f"Timed out waiting {int(STEADY_S * 1000)}ms" in rank0["first_error"]


def test_bad_values_are_one_config_error_naming_the_field() -> None:
    from meshtrain.config import load_config
    from meshtrain.errors import ConfigError

    for bad, says in (
        ({"timeout_minutes": 2, "first_step_timeout_minutes": 1}, "shorter than"),
        ({"first_step_timeout_minutes": 0}, "> 0"),
        ({"first_step_timeout_minutes": "long"}, "> 0"),
    ):
        with pytest.raises(ConfigError, match="distributed.first_step_timeout_minutes") as err:
            load_config({"distributed": bad})
        assert says in str(err.value) and "\n" not in str(err.value)
    ok = load_config({"distributed": {"timeout_minutes": 2, "first_step_timeout_minutes": 2}})
    assert ok.distributed.first_step_timeout_minutes == 2
