"""transformers' callback event-flow test restated: the exact sequence of events a
training run fires (test_trainer_callback.py::TrainerCallbackTest::test_event_flow), on
both implementations."""

from __future__ import annotations

import math

import pytest

from tests.conformance.trainer.peer import regression_trainer

EVENTS = (
    "on_init_end on_train_begin on_train_end on_epoch_begin on_epoch_end on_step_begin "
    "on_pre_optimizer_step on_optimizer_step on_substep_end on_step_end on_evaluate "
    "on_predict on_save on_log on_prediction_step"
).split()


def _recorder(impl):
    class Recorder(impl.TrainerCallback):
        def __init__(self):
            self.events = []

    for name in EVENTS:
        setattr(
            Recorder, name, lambda self, args, state, control, _n=name, **kw: self.events.append(_n)
        )
    return Recorder()


def _expected(args, max_steps: int, epochs: int, eval_batches: int, per_epoch: int):
    """The sequence transformers' test computes (its ``_get_expected_events``)."""
    out = ["on_init_end", "on_train_begin"]
    evaluation = ["on_prediction_step"] * eval_batches + ["on_log", "on_evaluate"]
    step = 0
    steps = lambda v: v if v >= 1 else math.ceil(v * max_steps)  # noqa: E731
    for _ in range(epochs):
        out.append("on_epoch_begin")
        for _ in range(per_epoch):
            step += 1
            out += ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
            if step % steps(args.logging_steps) == 0:
                out.append("on_log")
            is_steps = getattr(args.eval_strategy, "value", args.eval_strategy) == "steps"
            if is_steps and step % steps(args.eval_steps) == 0:
                out += evaluation
            if step == max_steps and is_steps and step % steps(args.eval_steps) != 0:
                out += evaluation
            if step % steps(args.save_steps) == 0 or step == max_steps:
                out.append("on_save")
        out.append("on_epoch_end")
        if getattr(args.eval_strategy, "value", args.eval_strategy) == "epoch":
            out += evaluation
    return out + ["on_log", "on_train_end"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"logging_steps": 5},
        {"save_steps": 5},
        {"eval_steps": 5, "eval_strategy": "steps"},
        {"eval_strategy": "epoch"},
        {"logging_steps": 3, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
        {"logging_steps": 3, "save_steps": 10, "eval_steps": 7, "eval_strategy": "steps"},
    ],
    ids=["default", "log5", "save5", "eval5", "epoch", "mixed", "eval7-last"],
)
def test_event_flow(impl, tmp_path, kwargs):
    """Restates test_trainer_callback.py::TrainerCallbackTest::test_event_flow (each of
    its configurations, plus a run whose last step is not an evaluation step)."""
    recorder = _recorder(impl)
    trainer = regression_trainer(impl, tmp_path, callbacks=[recorder], **kwargs)
    trainer.train()
    per_epoch = 64 // 8
    expected = _expected(trainer.args, trainer.state.max_steps, 3, 64 // 8, per_epoch)
    assert recorder.events == expected


def test_callback_can_stop_training(impl, tmp_path):
    """Restates test_trainer_callback.py::TrainerCallbackTest::
    test_callback_can_stop_training."""

    class Stop(impl.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= 1:
                control.should_training_stop = True
            return control

    trainer = regression_trainer(
        impl, tmp_path, callbacks=[Stop()], max_steps=10, logging_steps=1, save_strategy="no"
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_no_duplicate_save_on_epoch_strategy(impl, tmp_path):
    """Restates test_trainer_callback.py::TrainerCallbackTest::
    test_no_duplicate_save_on_epoch_strategy."""
    count = []

    class Counter(impl.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            count.extend([1] if control.should_save else [])

        def on_epoch_end(self, args, state, control, **kwargs):
            count.extend([1] if control.should_save else [])

    trainer = regression_trainer(
        impl, tmp_path, callbacks=[Counter()], max_steps=2, save_strategy="epoch"
    )
    trainer.train()
    assert len(count) == 1


def test_early_stopping(impl, tmp_path):
    """Restates test_trainer.py::TrainerIntegrationTest::test_early_stopping_callback:
    patience 1 with a threshold no step can beat stops after two evaluations."""
    trainer = regression_trainer(
        impl,
        tmp_path,
        callbacks=[impl.EarlyStoppingCallback(1, 100.0)],
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
    )
    trainer.train()
    assert trainer.state.global_step == 4


def test_event_flow_with_gradient_accumulation(impl, tmp_path):
    """Restates test_trainer_callback.py's event flow at gradient_accumulation_steps=2
    (transformers' ``_inner_training_loop``: ``on_substep_end`` after each micro-batch but
    the last, then the optimizer events)."""
    recorder = _recorder(impl)
    trainer = regression_trainer(
        impl,
        tmp_path,
        callbacks=[recorder],
        max_steps=2,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        save_strategy="no",
    )
    trainer.train()
    step = ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step",
            "on_step_end"]  # fmt: skip
    expected = ["on_init_end", "on_train_begin", "on_epoch_begin", *step, *step,
                "on_epoch_end", "on_log", "on_train_end"]  # fmt: skip
    assert recorder.events == expected


def _stateful_kwargs():
    return dict(
        load_best_model_at_end=True,
        save_strategy="steps",
        eval_strategy="steps",
        save_steps=2,
        eval_steps=2,
        max_steps=2,
    )


def test_early_stopping_state_persists(impl, tmp_path):
    """Restates test_trainer_callback.py::StatefulCallbackTest::
    test_early_stopping_state_persists: with restore_callback_states_from_checkpoint the
    resumed run's EarlyStoppingCallback has the saved patience and threshold."""
    cb = impl.EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=0.2)
    regression_trainer(impl, tmp_path, callbacks=[cb], **_stateful_kwargs()).train()
    trainer = regression_trainer(
        impl,
        tmp_path,
        callbacks=[impl.EarlyStoppingCallback()],
        restore_callback_states_from_checkpoint=True,
        **_stateful_kwargs(),
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    restored = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, impl.EarlyStoppingCallback)
    )
    assert (restored.early_stopping_patience, restored.early_stopping_threshold) == (5, 0.2)


def test_multiple_instances_of_same_stateful_callback(impl, tmp_path):
    """Restates test_trainer_callback.py::StatefulCallbackTest::
    test_multiple_instances_of_same_stateful_callback: each instance gets its own state."""

    class Stateful(impl.TrainerCallback, impl.ExportableState):
        def __init__(self, my_value="default"):
            self.my_value = my_value

        def state(self):
            return {"args": {"my_value": self.my_value}, "attributes": {}}

    first = [Stateful("first"), Stateful("second")]
    regression_trainer(impl, tmp_path, callbacks=first, **_stateful_kwargs()).train()
    trainer = regression_trainer(
        impl,
        tmp_path,
        callbacks=[Stateful(), Stateful()],
        restore_callback_states_from_checkpoint=True,
        **_stateful_kwargs(),
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    values = [c.my_value for c in trainer.callback_handler.callbacks if isinstance(c, Stateful)]
    assert values == ["first", "second"]


def test_trainer_state_holds_stateful_callbacks(impl, tmp_path):
    """Restates test_trainer_callback.py::StatefulCallbackTest::
    test_trainer_control_state_persists's file check: trainer_state.json of a checkpoint
    holds the TrainerControl and EarlyStoppingCallback states."""
    cb = impl.EarlyStoppingCallback(early_stopping_patience=3)
    regression_trainer(impl, tmp_path, callbacks=[cb], **_stateful_kwargs()).train()
    state = impl.TrainerState.load_from_json(str(tmp_path / "checkpoint-2" / "trainer_state.json"))
    saved = state.stateful_callbacks
    assert saved["EarlyStoppingCallback"]["args"]["early_stopping_patience"] == 3
    assert "TrainerControl" in saved
