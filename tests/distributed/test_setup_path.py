"""The one set-up path (``meshtrain/engine/start.py``) from each front door, on 2 real ranks.

Each door joins the process group itself (the harness does not join it first), so the
``distributed`` section of its config is what the group gets: the collective timeout
read back from the gloo process group must be the config's, from ``initialize``, from
``Accelerator`` and from the Trainer. A key that is accepted and ignored must warn from
each door (rank 0). Expert parallelism on a model without experts is refused by
``parallelize``, naming the key (every mesh dimension is built: cp in
test_context_parallel.py, ep in test_moe.py).
"""

from __future__ import annotations

import pytest

from meshtrain.launch.processes import run_on_ranks

TIMEOUT_MINUTES = 3.5  # not the harness's 2, not meshtrain's default 5, not torch's 30
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "contiguous_gradients": False},  # ignored key
    "distributed": {"timeout_minutes": TIMEOUT_MINUTES, "backend": "gloo"},
}


def _through(door: str):
    """Build an engine through ``door``; return (pg timeout s, backend, warnings, step ran)."""
    import logging

    import torch
    import torch.distributed as dist

    from tests.trainer.common import BasicNet, xy_rows

    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    logging.getLogger("meshtrain").addHandler(Keep(logging.WARNING))
    assert not dist.is_initialized()
    model = BasicNet()
    if door == "initialize":
        import meshtrain

        engine, *_ = meshtrain.initialize(model=model, config=dict(CONFIG))
    elif door == "accelerator":
        from meshtrain import Accelerator

        acc = Accelerator(config={k: v for k, v in CONFIG.items() if k != "optimizer"})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(xy_rows(8), batch_size=2)
        model, opt, loader = acc.prepare(model, opt, loader)
        engine = acc.engine
    else:
        from meshtrain import Trainer, TrainingArguments

        deepspeed = {k: v for k, v in CONFIG.items() if k != "optimizer"}
        args = TrainingArguments(
            "unused-out", per_device_train_batch_size=2, deepspeed=deepspeed, save_strategy="no"
        )
        engine = Trainer(model, args, train_dataset=xy_rows(8)).prepare_engine()
    x = torch.randn(2, 8)
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    world = dist.group.WORLD
    timeout = world._get_backend(torch.device("cpu")).options._timeout
    return timeout.total_seconds(), dist.get_backend(), [w for w in warned if "contiguous" in w]


@pytest.mark.parametrize("door", ["initialize", "accelerator", "trainer"])
def test_timeout_and_ignored_keys_from_every_door(door, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = run_on_ranks(_through, 2, (door,), timeout=240, setup_distributed=False)
    for rank, (timeout_s, backend, warnings) in enumerate(results):
        assert timeout_s == TIMEOUT_MINUTES * 60, (door, rank)
        assert backend == "gloo"
        if rank == 0:
            assert len(warnings) == 1, warnings
            assert "zero_optimization.contiguous_gradients" in warnings[0]
        else:
            assert warnings == []  # warned once, by rank 0


def _ep_without_experts():
    import meshtrain
    from meshtrain.errors import ConfigError
    from tests.trainer.common import BasicNet

    try:
        meshtrain.initialize(
            model=BasicNet(), config={**CONFIG, "mesh": {"expert_parallel_size": 2}}
        )
    except ConfigError as exc:
        return str(exc)
    return None


def test_expert_parallel_needs_experts():
    """ep is built (docs/moe.md): the config loads, and a model with no MoE layer is refused
    by name on every rank instead of running without expert parallelism."""
    for message in run_on_ranks(_ep_without_experts, 2, (), timeout=240, setup_distributed=False):
        assert message is not None and message.startswith(
            "mesh.expert_parallel_size: 2 but the model has no mixture-of-experts layer"
        ), message
