"""Table-driven checks of the rules that need no processes: checkpoint rotation, the best
metric, the flow of log/eval/save, TrainingArguments errors and the DeepSpeed mapping."""

from __future__ import annotations

import pytest

from meshtrain.errors import ConfigError
from meshtrain.trainer.arguments import TrainingArguments
from meshtrain.trainer.checkpoints import is_better, to_delete
from meshtrain.trainer.evaluation import interleave, pad_concat

ROTATION = [
    # steps, limit, best step, deleted
    ([1, 2, 3], None, None, []),
    ([1, 2, 3], 3, None, []),
    ([1, 2, 3, 4], 2, None, [1, 2]),
    ([1, 2, 3, 4], 2, 1, [2, 3]),  # the best counts as newest: best + newest survive
    ([1, 2, 3, 4], 3, 2, [1]),
    ([1, 2, 3, 4], 1, 4, [1, 2, 3]),
    ([1, 2, 3, 4], 1, 2, [1, 3]),  # limit 1, best not newest: keep both (#15089)
    ([1, 2, 3, 4], 1, None, [1, 2, 3]),
    ([5, 10, 15], 2, 10, [5]),
    ([10, 20, 30, 40, 50], 2, 10, [20, 30, 40]),  # the best is never deleted (#39560)
]


@pytest.mark.parametrize(("steps", "limit", "best", "deleted"), ROTATION)
def test_rotation(steps, limit, best, deleted):
    assert to_delete(steps, limit, best) == deleted
    if best is not None:
        assert best not in to_delete(steps, limit, best)
    if limit:
        assert max(steps) not in to_delete(steps, limit, best)  # resume point survives


BEST = [
    (0.5, None, True, True),
    (0.5, 0.4, True, True),
    (0.4, 0.5, True, False),
    (0.5, 0.5, True, False),  # a tie keeps the earlier checkpoint
    (0.3, 0.5, False, True),  # a loss: lower is better
    (0.5, 0.5, False, False),
]


@pytest.mark.parametrize(("value", "best", "greater", "better"), BEST)
def test_best_metric(value, best, greater, better):
    assert is_better(value, best, greater) is better


def test_metric_direction_defaults():
    assert TrainingArguments(metric_for_best_model="f1").greater_is_better is True
    assert TrainingArguments(metric_for_best_model="eval_loss").greater_is_better is False
    a = TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch")
    assert a.metric_for_best_model == "loss" and a.metric_key == "eval_loss"


ERRORS = [
    (dict(evaluation_strategy="sometimes"), "eval_strategy"),
    (dict(save_strategy="hourly"), "save_strategy"),
    (
        dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps"),
        "eval_strategy='epoch'",
    ),
    (dict(load_best_model_at_end=True), "needs"),
    (
        dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=3, save_steps=5),
        "multiple",
    ),
    (dict(per_device_train_batch_size=0), "per_device_train_batch_size"),
    (dict(learning_rate=-1.0), "learning_rate"),
    (dict(fp16=True, bf16=True), "fp16 and bf16"),
    (dict(optim="lion"), "optim"),
    (dict(lr_scheduler_type="wavy"), "lr_scheduler_type"),
    (dict(report_to="wandb"), "report_to"),
    (dict(eval_strategy="epoch", evaluation_strategy="steps"), "disagree"),
    (dict(adam_beta1=1.5), "adam_beta1"),
    (dict(mesh={"tensor_paralel_size": 2}), "mesh"),
]


@pytest.mark.parametrize(("kwargs", "needle"), ERRORS)
def test_argument_errors_name_the_field(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        TrainingArguments("out", **kwargs)


def test_old_evaluation_strategy_alias():
    a = TrainingArguments("out", evaluation_strategy="epoch")
    assert a.eval_strategy == "epoch" == a.evaluation_strategy


def test_deepspeed_mapping_fills_auto_and_refuses_contradictions():
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"},
        },
    }
    a = TrainingArguments(
        "out", deepspeed=ds, per_device_train_batch_size=4, learning_rate=3e-4, warmup_ratio=0.1
    )
    cfg = a.to_engine_config(total_steps=50)
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["optimizer"]["params"]["lr"] == 3e-4
    assert cfg["scheduler"]["params"]["total_num_steps"] == 50
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 5
    bad = TrainingArguments(
        "out", deepspeed={"train_micro_batch_size_per_gpu": 16}, per_device_train_batch_size=4
    )
    with pytest.raises(ConfigError, match="per_device_train_batch_size"):
        bad.to_engine_config()
    plain = TrainingArguments(
        "out", optim="sgd", weight_decay=0.1, mesh={"tensor_parallel_size": 1}
    )
    cfg = plain.to_engine_config()
    assert cfg["optimizer"] == {"type": "SGD", "params": {"lr": 5e-5, "weight_decay": 0.1}}


def test_interleave_restores_dataset_order_with_ragged_shapes():
    import numpy as np

    # 5 rows over 2 ranks: rank 0 has rows 0, 2, 4 (width 2), rank 1 rows 1, 3 (width 3)
    r0 = np.array([[0, 0], [2, 2], [4, 4]])
    r1 = np.array([[1, 1, 1], [3, 3, 3]])
    out = interleave([r0, r1], 5)
    assert out.tolist() == [[0, 0, -100], [1, 1, 1], [2, 2, -100], [3, 3, 3], [4, 4, -100]]
    assert pad_concat([np.ones((1, 1)), np.zeros((2, 2))]).shape == (3, 2)
    # fewer rows than ranks: rank 2 evaluated nothing (None), leaves nested in a tuple too
    out = interleave([np.array([[0.0]]), np.array([[1.0]]), None], 2)
    assert out.tolist() == [[0.0], [1.0]]
    pair = interleave([(np.array([0]), np.array([[5, 5]])), None], 1)
    assert pair[0].tolist() == [0] and pair[1].tolist() == [[5, 5]]


def test_evaluation_deals_whole_batches_and_restores_dataset_order():
    """The Trainer's evaluation deals batches of per_device_eval_batch_size whole (the
    transformers Trainer's eval loader, without its padding of the last global batch):
    7 rows, batch 2, 2 ranks -> rank 0 rows 0 1 4 5, rank 1 rows 2 3 6."""
    import numpy as np

    from meshtrain.trainer.evaluation import max_batches, rank_rows

    rows = [rank_rows(7, 2, r, 2) for r in range(2)]
    assert rows == [[0, 1, 4, 5], [2, 3, 6]]
    assert max_batches(7, 2, 2) == 2
    parts = [np.array([[i, i] for i in r]) for r in rows]
    assert interleave(parts, 7, rows)[:, 0].tolist() == list(range(7))
    assert rank_rows(1, 3, 2, 4) == []  # fewer rows than ranks: rank 2 evaluates nothing
