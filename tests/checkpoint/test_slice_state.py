"""Checkpoints of optimizer states that are not element-wise (``checkpoint.slice_state``):
AdamW8bit (blockwise 8-bit state) and Adafactor (factored second moment).

Protocol: train 3 steps, save, train 3 more (the uninterrupted run); a fresh engine loads
the checkpoint and trains the same 3 steps. Losses and parameters must be bit-identical
(``==``/``torch.equal``): the state is restored byte for byte and the same arithmetic
follows, so any difference is a restore bug. At another world size the state cannot be
placed: the load is refused naming ``load_optimizer_states=False``, and with that flag the
weights load (layout-free, as always) and training goes on.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.training import global_batch, make_model
from tests.harness import run_ranks

pytest.importorskip("bitsandbytes")

BATCH = 4
OPTIMIZERS = {
    "AdamW8bit": {"lr": 1e-2, "min_8bit_size": 256},
    "Adafactor": {"lr": 1e-2},
}


def _engine(name: str, zero: dict):
    import meshtrain

    torch.manual_seed(0)
    model = make_model("decoder")
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": name, "params": OPTIMIZERS[name]},
        "steps_per_print": 1000,
        "zero_optimization": zero,
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _train(engine, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x, y = global_batch("decoder", step, BATCH)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _resume(tmp: str, layouts) -> dict:
    import torch.distributed as dist

    out = {}
    for name, zero in layouts:
        key = f"{name}/{zero['stage']}"
        save = f"{tmp}/{key.replace('/', '_')}"
        engine = _engine(name, zero)
        _train(engine, 0, 3)
        engine.save_checkpoint(save, tag="t3")
        straight = _train(engine, 3, 3)
        resumed = _engine(name, zero)
        resumed.load_checkpoint(save, tag="t3")
        again = _train(resumed, 3, 3)
        same_state = all(
            torch.equal(a, b)
            for a, b in zip(
                engine.module_state_dict().values(),
                resumed.module_state_dict().values(),
                strict=True,
            )
        )
        out[key] = {"straight": straight, "again": again, "same_state": same_state}
    if dist.get_world_size() == 2 and dist.get_rank() == 0:
        out["saved_at_2"] = [f"{tmp}/{n}_{z['stage']}" for n, z in layouts]
    return out


def _other_world(paths: list[str], layouts) -> dict:
    from meshtrain.errors import CheckpointError

    out = {}
    for path, (name, zero) in zip(paths, layouts, strict=True):
        engine = _engine(name, zero)
        try:
            engine.load_checkpoint(path, tag="t3")
            out[name] = ("loaded", None)
        except CheckpointError as err:
            out[name] = ("refused", str(err))
        fresh = _engine(name, zero)
        fresh.load_checkpoint(path, tag="t3", load_optimizer_states=False)
        out[f"{name}/weights"] = _train(fresh, 3, 1)
    return out


def test_non_elementwise_optimizer_states_resume_bit_identically(tmp_path):
    layouts = [
        ("AdamW8bit", {"stage": 0}),
        ("Adafactor", {"stage": 0}),
        ("AdamW8bit", {"stage": 2}),
        ("Adafactor", {"stage": 2}),
        ("Adafactor", {"stage": 3, "stage3_param_persistence_threshold": 0}),
    ]
    one = run_ranks(_resume, 1, str(tmp_path / "one"), layouts[:2])[0]
    two = run_ranks(_resume, 2, str(tmp_path / "two"), layouts)[0]
    for got in (one, two):
        for key, r in got.items():
            if key == "saved_at_2":
                continue
            assert r["again"] == r["straight"], key
            assert r["same_state"], key
    # saved by 2 ranks at ZeRO-2, loaded by 1 process: refused by name; the weights load
    other = run_ranks(_other_world, 1, two["saved_at_2"][2:4], layouts[2:4])[0]
    for name in ("AdamW8bit", "Adafactor"):
        verdict, message = other[name]
        assert verdict == "refused", name
        assert "bound to the layout that saved it" in message
        assert "load_optimizer_states=False" in message
        assert len(other[f"{name}/weights"]) == 1 and other[f"{name}/weights"][0] > 0
