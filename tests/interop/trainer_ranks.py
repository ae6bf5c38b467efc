"""Rank functions of the transformers Trainer resume proof
(tests/interop/test_trainer_resume.py).

transformers 5.24's own ``Trainer`` trains a tiny Llama (``tests.tiny_models``) on padded
causal-LM rows (``tests.trainer.common``) for ``STEPS`` optimizer steps of ``GLOBAL`` rows
(``PER_DEVICE`` x ``GAS`` x its ranks), saving ``checkpoint-SAVE_AT/`` (model.safetensors,
optimizer.pt, scheduler.pt, rng_state*.pth, trainer_state.json, training_args.bin) in the
middle of an epoch, and runs on without stopping: its losses and final weights are the
reference. meshtrain's ``Trainer`` then builds the same model and arguments at another
rank count or ZeRO stage and resumes from that folder with ``resume_from_checkpoint``.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.tiny_models import tiny_llama
from tests.trainer.common import lm_rows, pad_collate

ROWS = 32
GLOBAL = 8  # rows per optimizer step, on every layout
GAS = 2
STEPS = 13  # 3 epochs of 4 steps and one more: the 10 steps after SAVE_AT cross 3 epoch ends
SAVE_AT = 3  # mid-epoch: the resumed run must skip 3 x GAS batches of epoch 0
LR = 1e-3
WEIGHT_DECAY = 0.01


def _args(cls, out: str, world: int, clip: float = 0.0, **extra):
    return cls(
        out,
        per_device_train_batch_size=GLOBAL // GAS // world,
        gradient_accumulation_steps=GAS,
        max_steps=extra.pop("max_steps", STEPS),
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=2,
        logging_steps=1,
        max_grad_norm=clip,
        report_to="none",
        disable_tqdm=True,
        **extra,
    )


def transformers_writes(out: str, clip: float = 0.0) -> dict:
    """The real transformers Trainer: ``STEPS`` steps, ``checkpoint-SAVE_AT`` saved on the
    way. Returns every logged loss and (rank 0) the final weights."""
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    world = dist.get_world_size() if dist.is_initialized() else 1
    args = _args(
        TrainingArguments, out, world, clip, save_strategy="steps", save_steps=SAVE_AT,
        save_total_limit=None, use_cpu=True,
    )  # fmt: skip
    model = tiny_llama(seed=0)
    trainer = Trainer(model, args, train_dataset=lm_rows(ROWS), data_collator=pad_collate)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights if trainer.is_world_process_zero() else None}


def meshtrain_resumes(ckpt: str, out: str, stage: int = 0, clip: float = 0.0) -> dict:
    """meshtrain's Trainer at this world size and ZeRO ``stage``, resumed from the
    transformers ``ckpt``. Returns the losses it logs after the resume, its state on
    resuming, and (rank 0) the final weights."""
    import torch.distributed as dist

    from meshtrain import Trainer, TrainerCallback, TrainingArguments

    world = dist.get_world_size() if dist.is_initialized() else 1
    extra = {"save_strategy": "no"}
    if stage:
        extra["deepspeed"] = {"zero_optimization": {"stage": stage}}
    args = _args(TrainingArguments, out, world, clip, **extra)
    model = tiny_llama(seed=1)  # other weights: everything must come from the checkpoint
    trainer = Trainer(model, args, train_dataset=lm_rows(ROWS), data_collator=pad_collate)
    seen: dict = {}

    class Spy(TrainerCallback):  # the state the loop resumed with, before its first step
        def on_train_begin(self, args, state, control, **kw):
            loaded = trainer.engine.module_state_dict()  # every rank gathers (ZeRO-3)
            seen.update(step=state.global_step, epoch=state.epoch, logged=len(state.log_history),
                        lr=[g["lr"] for g in trainer.engine.optimizer.param_groups],
                        scheduler=trainer.engine.lr_scheduler.state_dict(),
                        global_steps=trainer.engine.global_steps,
                        loaded={k: v.detach().clone() for k, v in loaded.items()})  # fmt: skip

        def on_step_begin(self, args, state, control, **kw):
            if "rng" not in seen:  # the streams the first resumed step starts from
                seen["rng"] = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state()[1]}

    trainer.add_callback(Spy())
    # streams unlike the saved ones: only the resume's restore brings those back
    torch.manual_seed(1234)
    np.random.seed(1234)
    trainer.train(resume_from_checkpoint=ckpt)
    history = trainer.state.log_history
    resumed = [h for h in history[seen["logged"] :] if "loss" in h]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if dist.get_rank() != 0:
        seen["loaded"] = seen["rng"] = None
    return {
        **seen,
        "losses": [h["loss"] for h in resumed],
        "lrs": [h["learning_rate"] for h in resumed],
        "history_before": [h["loss"] for h in history[: seen["logged"]] if "loss" in h],
        "weights": weights if dist.get_rank() == 0 else None,
    }


def meshtrain_error(ckpt: str, out: str, deepspeed: dict) -> str | None:
    """One rank with a ``deepspeed=`` config: the message resuming ``ckpt`` fails with."""
    from meshtrain import Trainer, TrainingArguments
    from meshtrain.errors import MeshtrainError

    args = _args(TrainingArguments, out, 1, save_strategy="no", deepspeed=deepspeed)
    trainer = Trainer(
        tiny_llama(seed=1), args, train_dataset=lm_rows(ROWS), data_collator=pad_collate
    )
    try:
        trainer.train(resume_from_checkpoint=ckpt)
    except MeshtrainError as exc:
        return str(exc)
    return None


def meshtrain_newest(out: str) -> dict:
    """``resume_from_checkpoint=True`` in an output_dir where transformers saved."""
    from meshtrain import Trainer, TrainerCallback, TrainingArguments

    args = _args(TrainingArguments, out, 1, save_strategy="no")
    trainer = Trainer(
        tiny_llama(seed=1), args, train_dataset=lm_rows(ROWS), data_collator=pad_collate
    )
    steps: list[int] = []

    class Spy(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            steps.append(state.global_step)

    trainer.add_callback(Spy())
    trainer.train(resume_from_checkpoint=True)
    return {"resumed_at": steps[0], "final": trainer.state.global_step}


__all__ = ["meshtrain_error", "meshtrain_newest", "meshtrain_resumes", "transformers_writes"]
