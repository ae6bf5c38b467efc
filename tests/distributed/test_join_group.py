"""Every front door joins the process group through ``distributed.env.join_group`` with the
config's whole ``distributed`` section (issue 45: side doors dropped ``backend`` and
``first_step_timeout_minutes``), and a group made before the config was read is kept:
another backend is refused by name, a first-step timeout it was not made with is said to
do nothing. Real processes (``run_on_ranks`` without its own group set-up, so that the
door under test makes the group); what is asserted is the group's own timeout and
backend, exactly."""

from __future__ import annotations

import warnings

from meshtrain.launch.processes import run_on_ranks

FIRST_MIN, STEADY_MIN = 7.0, 2.0
SECTION = {"timeout_minutes": STEADY_MIN, "first_step_timeout_minutes": FIRST_MIN}


def _zero_init() -> dict:
    """``zero.Init(config=...)`` makes the group with the config's section."""
    import torch.distributed as dist
    from torch import nn

    import meshtrain
    from meshtrain.distributed.store_io import pg_timeout_seconds

    config = {"zero_optimization": {"stage": 3}, "distributed": {**SECTION, "backend": "gloo"}}
    with meshtrain.zero.Init(config_dict_or_path=config):
        nn.Linear(4, 4)
    return {"timeout_s": pg_timeout_seconds(), "backend": dist.get_backend()}


def _existing_group() -> dict:
    """A group torch made (a 1-minute timeout): the engine's config cannot change it."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtrain.config.sections import DistributedConfig
    from meshtrain.distributed.env import join_group
    from meshtrain.errors import DistributedError

    dist.init_process_group("gloo", timeout=timedelta(minutes=1))
    out = {}
    try:
        join_group(DistributedConfig(backend="nccl"))
    except DistributedError as exc:
        out["backend"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        join_group(DistributedConfig(**SECTION))
        join_group(DistributedConfig(backend="gloo"))  # its own backend: nothing to say
    out["warnings"] = [str(w.message) for w in caught]
    dist.destroy_process_group()
    return out


def test_zero_init_joins_with_the_configs_section():
    for r in run_on_ranks(_zero_init, 2, setup_distributed=False, timeout=180):
        assert r == {"timeout_s": FIRST_MIN * 60, "backend": "gloo"}


def test_a_group_made_before_keeps_its_backend_and_says_what_does_nothing():
    (r, _) = run_on_ranks(_existing_group, 2, setup_distributed=False, timeout=180)
    assert r["backend"].startswith("distributed.backend nccl: the process group already ")
    assert "exists with gloo" in r["backend"] and 'or "auto"' in r["backend"]
    (said,) = r["warnings"]
    assert said.startswith(f"distributed.first_step_timeout_minutes {FIRST_MIN:g} does nothing")
    assert "already exists with a 1 min timeout" in said
