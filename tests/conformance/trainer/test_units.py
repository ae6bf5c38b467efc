"""transformers' unit-level Trainer tests restated (arguments, state, control, callback
handler, checkpoint sorting / rotation, EvalPrediction); each runs against both
implementations (``impl``). Each docstring names the peer test it restates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conformance.trainer.peer import RegressionModel


def _fake_checkpoints(root: Path, steps) -> None:
    for n in steps:
        (root / f"checkpoint-{n}").mkdir(parents=True, exist_ok=True)


def _steps(root: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in root.glob("checkpoint-*")}


def test_checkpoint_sorting(impl, tmp_path):
    """Restates test_trainer_checkpointing.py::TrainerCheckpointRotationTest::
    test_checkpoint_sorting (step order; the best moves just before the newest)."""
    _fake_checkpoints(tmp_path, [20, 5, 15, 25, 10])
    order = [int(p.rsplit("-", 1)[1]) for p in impl.sort_checkpoints(str(tmp_path))]
    assert order == [5, 10, 15, 20, 25]
    best = os.path.join(tmp_path, "checkpoint-5")
    order = [
        int(p.rsplit("-", 1)[1])
        for p in impl.sort_checkpoints(str(tmp_path), best_model_checkpoint=best)
    ]
    assert order == [10, 15, 20, 5, 25]
    best = os.path.join(tmp_path, "checkpoint-25")
    order = [
        int(p.rsplit("-", 1)[1])
        for p in impl.sort_checkpoints(str(tmp_path), best_model_checkpoint=best)
    ]
    assert order == [5, 10, 15, 20, 25]


@pytest.mark.parametrize(
    ("limit", "best", "kept"),
    [
        (2, None, {20, 25}),
        (2, 5, {5, 25}),
        (3, 5, {5, 20, 25}),
        (1, 5, {5, 25}),
        (1, 25, {25}),
        (2, 25, {20, 25}),
        (None, 5, {5, 10, 15, 20, 25}),
    ],
)
def test_checkpoint_rotation(impl, tmp_path, limit, best, kept):
    """Restates test_trainer_checkpointing.py::TrainerCheckpointRotationTest::
    test_checkpoint_rotation (save_total_limit with and without a best checkpoint: the
    newest and the best are always kept)."""
    _fake_checkpoints(tmp_path, [5, 10, 15, 20, 25])
    best_dir = None if best is None else os.path.join(tmp_path, f"checkpoint-{best}")
    impl.rotate_checkpoints(
        output_dir=str(tmp_path), save_total_limit=limit, best_model_checkpoint=best_dir
    )
    assert _steps(tmp_path) == kept


def test_get_last_checkpoint(impl, tmp_path):
    """Restates test_trainer_utils.py / test_trainer_checkpointing.py's use of
    get_last_checkpoint: the highest step wins; None without checkpoints."""
    assert impl.get_last_checkpoint(str(tmp_path)) is None
    _fake_checkpoints(tmp_path, [3, 12, 7])
    assert Path(impl.get_last_checkpoint(str(tmp_path))).name == "checkpoint-12"


def test_trainer_state_save_and_load_json(impl, tmp_path):
    """Restates test_trainer_callback.py::TrainerStateTest::test_save_and_load_json."""
    state = impl.TrainerState(epoch=1.5, global_step=100, max_steps=200, best_metric=0.95)
    path = os.path.join(tmp_path, "state.json")
    state.save_to_json(path)
    loaded = impl.TrainerState.load_from_json(path)
    assert (loaded.epoch, loaded.global_step, loaded.max_steps, loaded.best_metric) == (
        1.5,
        100,
        200,
        0.95,
    )


def test_trainer_state_log_history_initialized(impl):
    """Restates test_trainer_callback.py::TrainerStateTest::test_log_history_initialized."""
    assert impl.TrainerState().log_history == []


def test_trainer_state_stateful_callbacks_initialized(impl):
    """Restates test_trainer_callback.py::TrainerStateTest::
    test_stateful_callbacks_initialized."""
    assert impl.TrainerState().stateful_callbacks == {}


@pytest.mark.parametrize(
    ("given", "expected"), [((0.1, 0.2, 0.5), (10, 20, 50)), ((10, 20, 50), (10, 20, 50))]
)
def test_trainer_state_compute_steps(impl, given, expected):
    """Restates test_trainer_callback.py::TrainerStateTest::
    test_compute_steps_from_proportion and test_compute_steps_from_integers."""

    class Args:
        logging_steps, eval_steps, save_steps = given

    state = impl.TrainerState()
    state.compute_steps(Args(), max_steps=100)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == expected


def test_trainer_control_defaults(impl):
    """Restates the TrainerControl defaults test_trainer_callback.py relies on: every
    flag starts False."""
    c = impl.TrainerControl()
    assert not any((c.should_training_stop, c.should_epoch_stop, c.should_save, c.should_evaluate))
    assert c.should_log is False


def test_eval_prediction_unpacks(impl):
    """Restates test_trainer_utils.py's EvalPrediction checks: it unpacks as
    ``predictions, label_ids`` and indexes like a tuple."""
    pred = impl.EvalPrediction(predictions=[1, 2], label_ids=[3, 4])
    p, labels = pred
    assert (p, labels) == ([1, 2], [3, 4])
    assert pred[0] == [1, 2] and pred[1] == [3, 4]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("per_device_train_batch_size", 8),
        ("per_device_eval_batch_size", 8),
        ("gradient_accumulation_steps", 1),
        ("num_train_epochs", 3.0),
        ("max_steps", -1),
        ("learning_rate", 5e-5),
        ("weight_decay", 0.0),
        ("adam_beta1", 0.9),
        ("adam_beta2", 0.999),
        ("adam_epsilon", 1e-8),
        ("max_grad_norm", 1.0),
        ("warmup_steps", 0),
        ("logging_steps", 500),
        ("save_steps", 500),
        ("seed", 42),
        ("save_total_limit", None),
        ("load_best_model_at_end", False),
        ("metric_for_best_model", None),
        ("logging_first_step", False),
        ("eval_delay", 0),
    ],
)
def test_training_args_defaults(impl, tmp_path, field, value):
    """Restates test_training_args.py's defaults checks (transformers 5's defaults)."""
    args = impl.TrainingArguments(str(tmp_path))
    assert getattr(args, field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr_scheduler_type", "linear"),
        ("eval_strategy", "no"),
        ("save_strategy", "steps"),
        ("logging_strategy", "steps"),
        ("optim", "adamw_torch_fused"),
    ],
)
def test_training_args_default_strategies(impl, tmp_path, field, value):
    """Restates test_training_args.py's enum defaults (compared by value: transformers
    keeps enums whose ``.value`` is the string)."""
    got = getattr(impl.TrainingArguments(str(tmp_path)), field)
    assert getattr(got, "value", got) == value


def test_greater_is_better_from_metric_name(impl, tmp_path):
    """Restates test_training_args.py's metric_for_best_model rule: a name ending in
    "loss" is minimised, anything else maximised."""
    loss = impl.TrainingArguments(str(tmp_path), metric_for_best_model="eval_loss")
    acc = impl.TrainingArguments(str(tmp_path), metric_for_best_model="accuracy")
    assert loss.greater_is_better is False and acc.greater_is_better is True


def test_load_best_model_at_end_sets_loss_metric(impl, tmp_path):
    """Restates test_training_args.py: load_best_model_at_end without a metric tracks
    "loss" (minimised)."""
    args = impl.TrainingArguments(
        str(tmp_path),
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_steps=5,
        eval_steps=5,
    )
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False


def test_eval_steps_default_to_logging_steps(impl, tmp_path):
    """Restates test_training_args.py: eval_strategy="steps" without eval_steps uses
    logging_steps."""
    args = impl.TrainingArguments(str(tmp_path), eval_strategy="steps", logging_steps=7)
    assert args.eval_steps == 7


def test_load_best_model_needs_matching_strategies(impl, tmp_path):
    """Restates test_training_args.py's refusal of load_best_model_at_end when the
    evaluation and save strategies differ (transformers: ValueError; meshtrain:
    ConfigError, a ValueError)."""
    with pytest.raises(ValueError):
        impl.TrainingArguments(
            str(tmp_path),
            load_best_model_at_end=True,
            eval_strategy="epoch",
            save_strategy="steps",
        )


def test_set_seed_is_reproducible(impl):
    """Restates test_trainer_utils.py's set_seed check: the same seed, the same draws."""
    import numpy as np
    import torch

    impl.set_seed(3)
    first = (torch.rand(3), np.random.rand(3))
    impl.set_seed(3)
    second = (torch.rand(3), np.random.rand(3))
    assert torch.equal(first[0], second[0]) and (first[1] == second[1]).all()


def test_callback_handler_add_pop_remove(impl, tmp_path):
    """Restates test_trainer_callback.py::TrainerCallbackTest::test_add_callback_by_class,
    test_add_callback_by_instance, test_remove_callback_by_class,
    test_remove_callback_by_instance and test_pop_callback_returns_instance."""

    class Recorder(impl.TrainerCallback):
        pass

    args = impl.TrainingArguments(str(tmp_path), report_to="none", disable_tqdm=True)
    trainer = impl.Trainer(RegressionModel(), args)
    cbs = trainer.callback_handler.callbacks
    n = len(cbs)
    trainer.add_callback(Recorder)
    assert len(trainer.callback_handler.callbacks) == n + 1
    inst = Recorder()
    trainer.add_callback(inst)
    assert inst in trainer.callback_handler.callbacks
    trainer.remove_callback(inst)
    assert inst not in trainer.callback_handler.callbacks
    flow = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, impl.DefaultFlowCallback)
    )
    assert trainer.pop_callback(impl.DefaultFlowCallback) is flow
    assert not any(
        isinstance(c, impl.DefaultFlowCallback) for c in trainer.callback_handler.callbacks
    )
    trainer.remove_callback(Recorder)
    assert not any(isinstance(c, Recorder) for c in trainer.callback_handler.callbacks)
