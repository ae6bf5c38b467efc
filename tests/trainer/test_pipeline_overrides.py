"""The Trainer's user losses under a pipeline, against the same Trainer at pp 1.

Seed 003's script: ``MyTrainer`` overriding ``compute_loss`` (the seed's old signature,
``model(inputs["x"])`` then ``F.nll_loss``), its ``BasicNet`` CNN exactly as the seed
writes it (two convolutions, pooling, two linears, ``log_softmax``) but with the dropout
probabilities 0 (under a pipeline each rank draws its own dropout masks, so with dropout
the runs would differ by their masks, not by arithmetic), the seed's collator
(``{"x", "labels"}``), ``remove_unused_columns=False``, evaluation every epoch. The
pipeline cuts ``BasicNet`` from its traced forward (``parallel.pipeline.traced``: the
convolutions on stage 0, the linears on stage 1, the flattened activation crossing).
Per micro-batch the override runs on the last stage with ``model`` returning that
stage's outputs (``trainer.stage_outputs``).

Three Trainers, each at pp 1 (one process) and pp 2 (two processes), 2 epochs of 4
optimizer steps with gradient accumulation 2, AdamW:

* ``MyTrainer`` (``compute_loss`` overridden);
* the plain Trainer with ``compute_loss_func`` (a sum over the batch divided by
  ``num_items_in_batch``: the loss is already the window's share);
* a Trainer with ``label_names=["target"]`` (the collator names the labels ``target``)
  overriding both ``compute_loss`` and ``prediction_step``.

The stage chain runs the model's own ops in the same order and the window weights are the
same exact fractions. Without gradient clipping (``max_grad_norm=0``, a fourth run of
``MyTrainer``) every logged training loss, every evaluation loss, ``predict()``'s
predictions and the model after ``train()`` are **bitwise** those at pp 1
(``tolerance.EXACT``). With the default clipping (active: the norms are 3-9) the global
norm is summed per stage and then over the pipeline, another order than one process's
sum, so the runs are held to ``trajectory(1e-3, 8)`` (losses, eval losses, the whole
model normwise) and the predictions to ``composed`` of it over 4 maps. ``label_ids`` are
equal in every run.
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import run_ranks
from tests.tolerance import check, check_trajectory, composed, relative, trajectory

ROWS, EVAL_ROWS = 32, 12


class BasicNet(nn.Module):
    """Seed 003's model, as written there (dropout probabilities 0: module docstring)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.0)
        self.dropout2 = nn.Dropout(0.0)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)
        self.act = F.relu

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.act(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def digits(n: int, seed: int) -> list:
    """MNIST-shaped rows ``(image 1x28x28, label)``: a label the image's mean decides."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    y = (x[:, 0, :14].mean((1, 2)) * 40).long().clamp(-5, 4) + 5
    return [(x[i], int(y[i])) for i in range(n)]


def collate_fn(examples):  # seed 003's
    pixel_values = torch.stack([example[0] for example in examples])
    labels = torch.tensor([example[1] for example in examples])
    return {"x": pixel_values, "labels": labels}


def collate_target(examples):
    out = collate_fn(examples)
    return {"x": out["x"], "target": out.pop("labels")}


def _trainers():
    from meshtrain import Trainer

    class MyTrainer(Trainer):  # seed 003's override, import changed
        def compute_loss(self, model, inputs, return_outputs=False):
            outputs = model(inputs["x"])
            target = inputs["labels"]
            loss = F.nll_loss(outputs, target)
            return (loss, outputs) if return_outputs else loss

    class TargetTrainer(Trainer):  # custom label name, both overrides
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(inputs["x"])
            loss = F.nll_loss(outputs, inputs["target"])
            return (loss, outputs) if return_outputs else loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            with torch.no_grad():
                logits = model(inputs["x"])
                loss = F.nll_loss(logits, inputs["target"])
            return loss, (None if prediction_loss_only else logits), inputs["target"]

    def summed(outputs, labels, num_items_in_batch=None):  # evaluation passes no count
        n = labels.numel() if num_items_in_batch is None else num_items_in_batch
        return F.nll_loss(outputs, labels, reduction="sum") / n

    return {
        "my_trainer": (MyTrainer, {}, collate_fn, None),
        "my_trainer_unclipped": (MyTrainer, {}, collate_fn, None),
        "compute_loss_func": (Trainer, {"compute_loss_func": summed}, collate_fn, None),
        "label_names": (TargetTrainer, {}, collate_target, ["target"]),
    }


def _run(pp: int) -> dict:
    from meshtrain import TrainingArguments

    torch.set_num_threads(1)
    out = {}
    for name, (cls, kw, collate, labels) in _trainers().items():
        args = TrainingArguments(
            tempfile.mkdtemp(), per_device_train_batch_size=4, per_device_eval_batch_size=4,
            gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-3,
            eval_strategy="epoch", remove_unused_columns=False, logging_steps=1,
            save_strategy="no", disable_tqdm=True, report_to="none", label_names=labels,
            mesh={"pipeline_parallel_size": pp} if pp > 1 else None,
            max_grad_norm=0.0 if name.endswith("unclipped") else 1.0,
        )  # fmt: skip
        torch.manual_seed(0)
        model = BasicNet()
        trainer = cls(
            model, args, train_dataset=digits(ROWS, 1), eval_dataset=digits(EVAL_ROWS, 2),
            data_collator=collate, **kw,
        )  # fmt: skip
        trainer.train()
        pred = trainer.predict(digits(EVAL_ROWS, 3))
        hist = trainer.state.log_history
        out[name] = {
            "losses": [h["loss"] for h in hist if "loss" in h],
            "eval": [h["eval_loss"] for h in hist if "eval_loss" in h],
            "pred": (pred.predictions, pred.label_ids, pred.metrics["test_loss"]),
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "stages": None if trainer.engine.pipeline is None else sorted(trainer.engine.pipeline.stages),
        }  # fmt: skip
    return out


def test_seed003_my_trainer_and_user_losses_at_pp2_equal_pp1():
    (ref,) = run_ranks(_run, 1, 1)
    pp2 = run_ranks(_run, 2, 2)
    bound = trajectory(1e-3, 8)  # peak rate every step
    for name, want in ref.items():
        assert len(want["losses"]) == 8 and len(want["eval"]) == 2, (name, want)
        for rank, got in enumerate(pp2):
            got = got[name]
            what = f"{name} pp2 rank {rank}"
            assert got["stages"] == [rank]
            p, lab, loss = got["pred"]
            assert p.shape == (EVAL_ROWS, 10) and np.array_equal(lab, want["pred"][1]), what
            if name.endswith("unclipped"):  # the same ops in the same order: bitwise
                assert got["losses"] == want["losses"], (what, got["losses"], want["losses"])
                assert got["eval"] == want["eval"], what
                assert np.array_equal(p, want["pred"][0]) and loss == want["pred"][2], what
                for k, v in want["weights"].items():
                    assert torch.equal(got["weights"][k], v), (what, k)
                continue
            # clipping: the global norm sums the stages' squares in another order
            check_trajectory(
                what, (got["losses"], got["weights"]), (want["losses"], want["weights"]), bound
            )
            for a, b in zip(got["eval"] + [loss], want["eval"] + [want["pred"][2]], strict=True):
                check(f"{what} eval loss", abs(a - b) / abs(b), bound)
            # log-probabilities through 4 maps (2 convolutions, 2 linears)
            check(f"{what} predictions", relative(p, want["pred"][0]), composed(bound, 4))
