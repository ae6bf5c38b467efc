"""A rank started with another config or another meshtrain version is refused before any
step: every rank raises the same ConfigError naming that rank, its node and the first
differing keys (``meshtrain.engine.agreement``). Real gloo ranks through
``meshtrain.initialize``; one group runs the three cases in turn (a process's n-th engine
is compared with the other ranks' n-th)."""

from __future__ import annotations

from tests.harness import run_ranks


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
    }


def _cases() -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    import meshtrain
    from meshtrain.errors import ConfigError

    rank = dist.get_rank()

    def start(stage: int) -> str | None:
        try:
            torch.manual_seed(0)
            meshtrain.initialize(model=nn.Linear(4, 1), config=_config(stage))
        except ConfigError as exc:
            return str(exc)
        return None

    same = start(1)
    config = start(2 if rank == 1 else 1)
    real = meshtrain.__version__
    if rank == 1:
        meshtrain.__version__ = "9.9.9"  # another install on node 1
    version = start(1)
    meshtrain.__version__ = real
    return {"same": same, "config": config, "version": version}


def test_other_config_or_version_refused_on_every_rank() -> None:
    results = run_ranks(_cases, 2)
    for r in results:
        assert r["same"] is None, r["same"]
        assert r["config"] == results[0]["config"] and r["version"] == results[0]["version"]
    config, version = results[0]["config"], results[0]["version"]
    assert config is not None and version is not None
    assert config.startswith("rank 1 (node 0, host ") and "than rank 0 (node 0" in config
    assert "zero_optimization.stage: 2 here, 1 on rank 0" in config
    assert version.startswith("rank 1 (node 0, host ")
    assert f"meshtrain 9.9.9 here, {meshtrain_version()} on rank 0" in version
    assert "\n" not in config + version


def meshtrain_version() -> str:
    import meshtrain

    return meshtrain.__version__
