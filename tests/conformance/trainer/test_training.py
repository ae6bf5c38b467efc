"""transformers' Trainer integration tests restated on the regression model: training,
evaluation, prediction, checkpoints, resume, best model, callbacks' event order and the
overridable methods' signatures. Each runs against both implementations (``impl``) in
the same session; each docstring names the peer test it restates. Tolerances: exact
where transformers' own test is exact (same process, same data order rule per
implementation); the two implementations are never compared number to number here
(their data orders differ), only each against its own contract."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conformance.trainer.peer import (
    AlmostAccuracy,
    RegressionDataset,
    RegressionModel,
    pretrained_model,
    regression_trainer,
)


def test_trainer_works_with_dict(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_trainer_works_with_dict:
    dict rows train and evaluate."""
    trainer = regression_trainer(impl, tmp_path, max_steps=4, save_strategy="no")
    trainer.train()
    assert "eval_loss" in trainer.evaluate()


def test_number_of_steps_in_training(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_number_of_steps_in_training:
    epochs x ceil(rows / batch) steps, or max_steps."""
    trainer = regression_trainer(impl, tmp_path, save_strategy="no")
    assert trainer.train().global_step == 3 * 64 // 8
    trainer = regression_trainer(impl, tmp_path, num_train_epochs=1.5, save_strategy="no")
    assert trainer.train().global_step == int(1.5 * 64 / 8)
    trainer = regression_trainer(impl, tmp_path, max_steps=10, save_strategy="no")
    assert trainer.train().global_step == 10


def test_gradient_accumulation_steps(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_gradient_accumulation:
    accumulation 2 at batch 4 counts steps of 8 rows."""
    trainer = regression_trainer(
        impl,
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        save_strategy="no",
    )
    assert trainer.train().global_step == 24


def test_reproducible_training(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_reproducible_training: the
    same seed trains the same weights twice (exact)."""
    a = regression_trainer(impl, tmp_path / "a", learning_rate=0.1, save_strategy="no")
    a.train()
    b = regression_trainer(impl, tmp_path / "b", learning_rate=0.1, save_strategy="no")
    b.train()
    assert a.model.a.item() == b.model.a.item() and a.model.b.item() == b.model.b.item()


def test_training_learns(impl, tmp_path):
    """Restates test_trainer.py's trained-regression checks: at lr 0.1 the fit moves
    toward a=2, b=3 (AlmostAccuracy rises)."""
    trainer = regression_trainer(
        impl, tmp_path, learning_rate=0.1, save_strategy="no", compute_metrics=AlmostAccuracy()
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    assert after > before


def test_evaluate(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_evaluate: eval_loss is the
    MSE of the fit over the whole set; compute_metrics sees every row."""
    trainer = regression_trainer(impl, tmp_path, a=1.5, b=2.5, compute_metrics=AlmostAccuracy())
    results = trainer.evaluate()
    data = RegressionDataset()
    pred = 1.5 * data.x + 2.5
    assert results["eval_loss"] == pytest.approx(float(((pred - data.y) ** 2).mean()), rel=1e-5)
    expected = float((np.abs(pred - data.y) <= 0.25).astype(np.float32).mean())
    assert results["eval_accuracy"] == pytest.approx(expected)


def test_evaluate_uneven_rows(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_evaluate's second case:
    66 rows (not a multiple of the batch) are each counted once."""
    trainer = regression_trainer(impl, tmp_path, a=1.5, b=2.5, eval_len=66)
    data = RegressionDataset(length=66)
    pred = 1.5 * data.x + 2.5
    assert trainer.evaluate()["eval_loss"] == pytest.approx(
        float(((pred - data.y) ** 2).mean()), rel=1e-5
    )


def test_evaluate_metric_key_prefix(impl, tmp_path):
    """Restates test_trainer.py's metric_key_prefix checks: every key carries it."""
    trainer = regression_trainer(impl, tmp_path)
    keys = trainer.evaluate(metric_key_prefix="dev")
    assert "dev_loss" in keys and all(k.startswith("dev_") for k in keys if k != "epoch")


def test_predict(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_predict: one prediction per
    row, in order, with the labels."""
    trainer = regression_trainer(impl, tmp_path, a=1.5, b=2.5)
    out = trainer.predict(trainer.eval_dataset)
    data = RegressionDataset()
    np.testing.assert_allclose(out.predictions, 1.5 * data.x + 2.5, rtol=1e-5)
    np.testing.assert_allclose(out.label_ids, data.y)
    assert "test_loss" in out.metrics


def test_predict_uneven_rows(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_predict's 66-row case."""
    trainer = regression_trainer(impl, tmp_path, a=1.5, b=2.5, eval_len=66)
    out = trainer.predict(trainer.eval_dataset)
    np.testing.assert_allclose(
        out.predictions, 1.5 * RegressionDataset(length=66).x + 2.5, rtol=1e-5
    )


def test_predict_double_output(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_predict with
    double_output=True: a tuple of predictions."""
    trainer = regression_trainer(impl, tmp_path, a=1.5, b=2.5, double_output=True)
    preds = trainer.predict(trainer.eval_dataset).predictions
    expected = 1.5 * RegressionDataset().x + 2.5
    assert len(preds) == 2
    np.testing.assert_allclose(preds[0], expected, rtol=1e-5)
    np.testing.assert_allclose(preds[1], expected, rtol=1e-5)


def test_prediction_loss_only(impl, tmp_path):
    """Restates test_trainer.py's prediction_loss_only checks: no predictions, a loss."""
    trainer = regression_trainer(impl, tmp_path, prediction_loss_only=True)
    out = trainer.predict(trainer.eval_dataset)
    assert out.predictions is None and "test_loss" in out.metrics


def test_log_history_and_train_metrics(impl, tmp_path):
    """Restates test_trainer.py's log checks: the last log holds train_runtime and
    train_loss; logging_steps logs loss, grad_norm and learning_rate."""
    trainer = regression_trainer(impl, tmp_path, logging_steps=5, save_strategy="no")
    out = trainer.train()
    logs = trainer.state.log_history
    assert "train_runtime" in logs[-1] and "train_loss" in logs[-1]
    step_logs = [h for h in logs if "loss" in h]
    assert [h["step"] for h in step_logs] == [5, 10, 15, 20]
    assert {"grad_norm", "learning_rate", "epoch"} <= set(step_logs[0])
    assert out.training_loss == pytest.approx(logs[-1]["train_loss"])


def test_linear_schedule_logged_lr(impl, tmp_path):
    """Restates test_trainer.py's learning-rate schedule checks: linear decay from
    learning_rate to 0 over max_steps, the logged lr is the one the step used."""
    trainer = regression_trainer(
        impl, tmp_path, learning_rate=0.1, max_steps=10, logging_steps=1, save_strategy="no"
    )
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs == pytest.approx([0.1 * (10 - s) / 10 for s in range(10)])


def test_warmup_steps(impl, tmp_path):
    """Restates test_trainer.py's warmup checks: lr rises linearly over warmup_steps."""
    trainer = regression_trainer(
        impl,
        tmp_path,
        learning_rate=0.1,
        max_steps=10,
        warmup_steps=4,
        logging_steps=1,
        save_strategy="no",
    )
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs[:4] == pytest.approx([0.0, 0.025, 0.05, 0.075])


def test_save_checkpoints(impl, tmp_path):
    """Restates test_trainer_checkpointing.py::TrainerCheckpointSaveTest::
    test_save_checkpoints: every save_steps a checkpoint-N with the weights, the state
    and the arguments (also for a plain nn.Module)."""
    trainer = regression_trainer(impl, tmp_path, save_steps=5)
    trainer.train()
    steps = sorted(
        int(p.split("-")[1]) for p in os.listdir(tmp_path) if p.startswith("checkpoint-")
    )
    assert steps == [5, 10, 15, 20, 24]
    for s in steps:
        folder = tmp_path / f"checkpoint-{s}"
        assert (folder / "model.safetensors").is_file()
        assert (folder / "trainer_state.json").is_file()
        assert (folder / impl.args_file).is_file()
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["global_step"] == s


def test_save_checkpoints_pretrained_loads(impl, tmp_path):
    """Restates test_trainer_checkpointing.py::TrainerCheckpointSaveTest::
    test_save_checkpoints (PreTrainedModel case) with its check_saved_checkpoints:
    config.json + model.safetensors, and ``from_pretrained`` loads the folder's weights."""
    trainer = regression_trainer(impl, tmp_path, pretrained=True, save_steps=5, learning_rate=0.1)
    trainer.train()
    folder = tmp_path / "checkpoint-24"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    cls = pretrained_model()[1]
    loaded = cls.from_pretrained(str(folder))
    assert loaded.a.item() == pytest.approx(trainer.model.a.item())
    assert loaded.b.item() == pytest.approx(trainer.model.b.item())


def test_save_model_and_state(impl, tmp_path):
    """Restates test_trainer.py's save_model / save_state checks: the weights and
    trainer_state.json in output_dir."""
    trainer = regression_trainer(impl, tmp_path, max_steps=2, save_strategy="no")
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "trainer_state.json").is_file()


def test_save_total_limit(impl, tmp_path):
    """Restates test_trainer_checkpointing.py's save_total_limit run: only the newest
    ``limit`` checkpoints remain."""
    trainer = regression_trainer(impl, tmp_path, save_steps=5, save_total_limit=2)
    trainer.train()
    steps = sorted(
        int(p.split("-")[1]) for p in os.listdir(tmp_path) if p.startswith("checkpoint-")
    )
    assert steps == [20, 24]


@pytest.mark.parametrize("pretrained", [False, True])
def test_can_resume_training(impl, tmp_path, pretrained):
    """Restates test_trainer_checkpointing.py::TrainerResumeTrainingTest::
    test_can_resume_training: resuming from checkpoint-5 and checkpoint-15 ends at the
    same weights and state as the uninterrupted run (exact)."""
    kw = dict(
        train_len=128, save_steps=5, learning_rate=0.1, logging_steps=5, pretrained=pretrained
    )
    trainer = regression_trainer(impl, tmp_path, **kw)
    trainer.train()
    a, b = trainer.model.a.item(), trainer.model.b.item()
    steps = trainer.state.global_step
    for tag in ("checkpoint-5", "checkpoint-15"):
        again = regression_trainer(impl, tmp_path, **kw)
        again.train(resume_from_checkpoint=str(tmp_path / tag))
        assert (again.model.a.item(), again.model.b.item()) == (a, b)
        assert again.state.global_step == steps


def test_resume_with_gradient_accumulation(impl, tmp_path):
    """Restates test_trainer_checkpointing.py::TrainerResumeTrainingTest::
    test_resume_training_with_gradient_accumulation (exact)."""
    kw = dict(
        train_len=128,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        save_steps=5,
        learning_rate=0.1,
    )
    trainer = regression_trainer(impl, tmp_path, **kw)
    trainer.train()
    a, b = trainer.model.a.item(), trainer.model.b.item()
    again = regression_trainer(impl, tmp_path, **kw)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert (again.model.a.item(), again.model.b.item()) == (a, b)


def test_resume_from_checkpoint_true_needs_one(impl, tmp_path):
    """Restates test_can_resume_training's failure case: resume_from_checkpoint=True in a
    fresh output_dir raises."""
    trainer = regression_trainer(impl, tmp_path, max_steps=2)
    with pytest.raises((ValueError, RuntimeError)):  # transformers: ValueError
        trainer.train(resume_from_checkpoint=True)


def test_resume_from_bogus_checkpoint(impl, tmp_path):
    """Restates test_can_resume_training's bogus-path case: a missing folder raises."""
    trainer = regression_trainer(impl, tmp_path, max_steps=2)
    with pytest.raises((ValueError, RuntimeError)):  # transformers: ValueError
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5-bogus"))


def test_training_with_resume_from_checkpoint_false(impl, tmp_path):
    """Restates test_trainer_checkpointing.py::TrainerResumeTrainingTest::
    test_training_with_resume_from_checkpoint_false."""
    trainer = regression_trainer(impl, tmp_path, max_steps=3, save_steps=5)
    assert trainer.train(resume_from_checkpoint=False).global_step == 3


def test_load_best_model_at_end(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_load_best_model_at_end:
    best_model_checkpoint names a checkpoint of the run and the model ends with its
    eval_loss."""
    trainer = regression_trainer(
        impl,
        tmp_path,
        a=1.5,
        b=2.5,
        learning_rate=0.1,
        eval_steps=5,
        save_steps=5,
        eval_strategy="steps",
        load_best_model_at_end=True,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert trainer.state.best_metric == pytest.approx(min(evals))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(min(evals), rel=1e-5)


def test_best_kept_with_save_total_limit(impl, tmp_path):
    """Restates test_trainer_checkpointing.py's rotation with load_best_model_at_end
    (transformers keeps the best and the most recent): the best checkpoint survives."""
    trainer = regression_trainer(
        impl,
        tmp_path,
        a=1.5,
        b=2.5,
        learning_rate=0.5,
        eval_steps=5,
        save_steps=5,
        eval_strategy="steps",
        load_best_model_at_end=True,
        save_total_limit=2,
    )
    trainer.train()
    kept = sorted(int(p.split("-")[1]) for p in os.listdir(tmp_path) if p.startswith("checkpoint-"))
    best = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1])
    assert best in kept and max(kept) == 24 and len(kept) <= 2


def test_save_total_limit_one_keeps_only_best(impl, tmp_path):
    """Restates test_trainer_checkpointing.py's save_total_limit=1 with
    load_best_model_at_end: after training only the best checkpoint is left."""
    trainer = regression_trainer(
        impl,
        tmp_path,
        a=1.5,
        b=2.5,
        learning_rate=0.5,
        eval_steps=5,
        save_steps=5,
        eval_strategy="steps",
        load_best_model_at_end=True,
        save_total_limit=1,
    )
    trainer.train()
    kept = [p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")]
    assert kept == [os.path.basename(trainer.state.best_model_checkpoint)]


def test_training_step_signature(impl, tmp_path):
    """Restates the training_step contract test_trainer.py's custom-trainer tests use:
    ``training_step(model, inputs, num_items_in_batch=None)`` is called per micro-batch
    and returns a detached scalar loss."""
    seen = []

    class MyTrainer(impl.Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            seen.append((loss.dim(), loss.requires_grad))
            return loss

    trainer = regression_trainer(
        impl,
        tmp_path,
        trainer_cls=MyTrainer,
        max_steps=3,
        gradient_accumulation_steps=2,
        save_strategy="no",
    )
    trainer.train()
    assert seen == [(0, False)] * 6


def test_compute_loss_old_signature(impl, tmp_path):
    """Restates test_trainer.py's custom compute_loss tests: an override taking
    ``num_items_in_batch`` (the new signature) trains, and its loss is what is logged."""

    class MyTrainer(impl.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(inputs["input_x"])
            loss = torch.nn.functional.mse_loss(out[0], inputs["labels"])
            return (loss, out) if return_outputs else loss

    trainer = regression_trainer(
        impl, tmp_path, trainer_cls=MyTrainer, max_steps=4, logging_steps=1, save_strategy="no"
    )
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 4


def test_prediction_step_signature(impl, tmp_path):
    """Restates test_trainer.py's prediction_step contract: ``(loss, logits, labels)``
    with ``prediction_step(model, inputs, prediction_loss_only, ignore_keys=None)``."""
    trainer = regression_trainer(impl, tmp_path, a=1.0, b=0.0)
    batch = {"input_x": torch.tensor([1.0, 2.0]), "labels": torch.tensor([1.0, 2.0])}
    if impl.name == "meshtrain":
        trainer.prepare_engine()
    loss, logits, labels = trainer.prediction_step(trainer.model, batch, False, ignore_keys=None)
    assert float(loss) == pytest.approx(0.0)
    np.testing.assert_allclose(np.asarray(logits), [1.0, 2.0])
    np.testing.assert_allclose(np.asarray(labels), [1.0, 2.0])
    loss, logits, labels = trainer.prediction_step(trainer.model, batch, True)
    assert logits is None and labels is None


def test_create_optimizer(impl, tmp_path):
    """Restates test_trainer_optimizers.py's create_optimizer contract: AdamW at the
    arguments' learning rate, kept in ``trainer.optimizer`` and returned again."""
    trainer = regression_trainer(impl, tmp_path, learning_rate=0.01, optim="adamw_torch")
    opt = trainer.create_optimizer()
    assert opt is trainer.optimizer and trainer.create_optimizer() is opt
    assert isinstance(opt, torch.optim.AdamW)
    assert all(g["lr"] == 0.01 for g in opt.param_groups)


def test_custom_optimizer(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_custom_optimizer: an SGD
    passed in ``optimizers=`` trains the model with its own learning rate."""
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda x: 1.0)
    args = impl.TrainingArguments(str(tmp_path), report_to="none", save_strategy="no")
    trainer = impl.Trainer(
        model, args, train_dataset=RegressionDataset(), optimizers=(optimizer, scheduler)
    )
    trainer.train()
    assert trainer.model.a.item() != 0.0
    lrs = [h.get("learning_rate") for h in trainer.state.log_history]
    assert lrs[-1] is None or lrs[-1] == 1.0
