"""Rank functions of the DeepSpeed resume proof (tests/interop/test_deepspeed_resume.py).

DeepSpeed 0.19.8 itself trains the parity tests' tiny decoder (``tests.distributed.training``)
on 2 gloo CPU ranks for ``SAVE_AT`` steps, saves (``client_state`` included), and goes on
for ``STEPS`` more (its own continuation from the state it saved), then saves again, so the
reference weights are read back with DeepSpeed's own ``zero_to_fp32``. meshtrain then
builds the same model and optimizer at another rank count or ZeRO stage, resumes from the
first checkpoint with ``engine.load_checkpoint`` and trains the same ``STEPS`` on the same
global batches.
"""

from __future__ import annotations

import torch

from tests.distributed.training import global_batch, make_model, train_steps

SAVE_AT = 3
STEPS = 10
GLOBAL = 8  # rows per optimizer step, split evenly over the ranks
LR = 1e-3
SCHEDULER = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 5},
}
CLIENT_STATE = {"epoch": 7, "note": "from deepspeed"}
# Said on both sides: DeepSpeed's default is 1.0, meshtrain's 0 (no clipping).
CLIP = 1.0


def deepspeed_writes(out: str, stage: int, bf16: bool = False) -> list[float]:
    """DeepSpeed: ``SAVE_AT`` steps, save to ``out/first``, ``STEPS`` more, save to
    ``out/last``. Returns the losses of the ``STEPS`` continued steps (mean over ranks)."""
    import deepspeed
    import torch.distributed as dist

    torch.manual_seed(0)
    model = make_model("decoder")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "scheduler": SCHEDULER,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**6,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL // world
    losses = []
    for step in range(SAVE_AT + STEPS):
        if step == SAVE_AT:
            engine.save_checkpoint(f"{out}/first", client_state=CLIENT_STATE)
        x, y = global_batch("decoder", step, GLOBAL)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().double().reshape(1)
        dist.all_reduce(t)
        if step >= SAVE_AT:
            losses.append(float(t) / world)
    engine.save_checkpoint(f"{out}/last")
    return losses


def meshtrain_resumes(
    ckpt: str, stage: int, load_optimizer: bool = True, bf16: bool = False
) -> dict:
    """meshtrain at this world size and ZeRO ``stage``: resume from DeepSpeed's ``ckpt``
    and train ``STEPS`` steps. Returns what the test compares."""
    import torch.distributed as dist

    import meshtrain

    torch.manual_seed(0)
    model = make_model("decoder")
    world = dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": SCHEDULER,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**6,
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    path, client = engine.load_checkpoint(ckpt, load_optimizer_states=load_optimizer)
    resumed = {
        "path": str(path),
        "client_state": client,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "scheduler": engine.lr_scheduler.state_dict(),
    }
    lrs, losses = [], []
    for step in range(SAVE_AT, SAVE_AT + STEPS):
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        losses += train_steps(engine, "decoder", 1, GLOBAL // world, 1, first_step=step)[0]
    state = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    return {
        **resumed,
        "lrs": lrs,
        "losses": losses,
        "state": state if dist.get_rank() == 0 else None,
    }


def meshtrain_module_only(ckpt: str) -> dict:
    """``load_module_only=True`` at 2 ranks, ZeRO 1: the weights only."""
    import torch.distributed as dist

    import meshtrain

    torch.manual_seed(0)
    model = make_model("decoder")
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**6,
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    _, client = engine.load_checkpoint(ckpt, load_module_only=True)
    states = [v for s in engine.optimizer.state.values() for k, v in s.items() if k == "exp_avg"]
    norm = sum(float(v.norm()) for v in states)
    loss = train_steps(
        engine, "decoder", 1, GLOBAL // dist.get_world_size(), 1, first_step=SAVE_AT
    )[0]
    return {"global_steps": engine.global_steps - 1, "client_state": client,
            "first_loss": loss[0], "exp_avg_norm_before": norm}  # fmt: skip


class RunsCode:
    """A pickle that would run a shell command when unpickled (what a hostile file does)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def bad_inputs(folders: dict) -> dict:
    """One rank, ZeRO 1: ``engine.load_checkpoint`` on each bad folder; the messages."""
    import meshtrain
    from meshtrain.errors import CheckpointError

    out = {}
    for what, (kind, folder) in folders.items():
        torch.manual_seed(0)
        model = make_model(kind)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**6,
        }
        engine, *_ = meshtrain.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        try:
            engine.load_checkpoint(folder)
            out[what] = None
        except CheckpointError as exc:
            out[what] = str(exc)
    return out
