"""The two implementations the conformance tests run against, and transformers'
regression test fixtures restated (``tests/trainer/trainer_test_utils.py``:
``RegressionDataset``, ``RegressionModel``, ``RegressionPreTrainedModel``,
``AlmostAccuracy``), in our own code."""

from __future__ import annotations

import types

import numpy as np
import torch
from torch import nn

IMPLS = ("meshtrain", "transformers")


def implementation(name: str) -> types.SimpleNamespace:
    """The public names a Trainer script imports, from ``name``'s package."""
    if name == "meshtrain":
        import meshtrain
        from meshtrain.trainer import checkpoints, state
        from meshtrain.trainer.callbacks import DefaultFlowCallback

        return types.SimpleNamespace(
            name=name,
            Trainer=meshtrain.Trainer,
            TrainingArguments=meshtrain.TrainingArguments,
            TrainerCallback=meshtrain.TrainerCallback,
            EarlyStoppingCallback=meshtrain.EarlyStoppingCallback,
            DefaultFlowCallback=DefaultFlowCallback,
            TrainerState=state.TrainerState,
            TrainerControl=state.TrainerControl,
            ExportableState=state.ExportableState,
            EvalPrediction=state.EvalPrediction,
            set_seed=meshtrain.trainer.set_seed,
            get_last_checkpoint=checkpoints.get_last_checkpoint,
            sort_checkpoints=checkpoints.sort_checkpoints,
            rotate_checkpoints=checkpoints.rotate_checkpoints,
            args_file="training_args.json",
        )
    import transformers
    from transformers import trainer_callback, trainer_utils

    return types.SimpleNamespace(
        name=name,
        Trainer=transformers.Trainer,
        TrainingArguments=transformers.TrainingArguments,
        TrainerCallback=transformers.TrainerCallback,
        EarlyStoppingCallback=transformers.EarlyStoppingCallback,
        DefaultFlowCallback=transformers.DefaultFlowCallback,
        TrainerState=transformers.TrainerState,
        TrainerControl=transformers.TrainerControl,
        ExportableState=trainer_callback.ExportableState,
        EvalPrediction=transformers.EvalPrediction,
        set_seed=transformers.set_seed,
        get_last_checkpoint=trainer_utils.get_last_checkpoint,
        sort_checkpoints=trainer_utils.sort_checkpoints,
        rotate_checkpoints=trainer_utils.rotate_checkpoints,
        args_file="training_args.bin",
    )


class RegressionDataset:
    """``y = a x + b + noise`` rows as dicts (``input_x``, ``labels``)."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int = 42):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (a * self.x + b + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, np.float32]:
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionModel(nn.Module):
    """``y = a x + b``; with labels returns ``(mse, y)`` as transformers' tuple models do."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))
        self.double_output = double_output
        self.config = None

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return (y, y) if self.double_output else (y,)
        loss = nn.functional.mse_loss(y, labels)
        return (loss, y, y) if self.double_output else (loss, y)


def pretrained_model(a: float = 0, b: float = 0):
    """A ``PreTrainedModel`` of the same regression (``from_pretrained`` can load it)."""
    from transformers import PretrainedConfig, PreTrainedModel

    class RegressionConfig(PretrainedConfig):
        model_type = "meshtrain-regression"

        def __init__(self, a=0.0, b=0.0, **kwargs):
            super().__init__(**kwargs)
            self.a, self.b = a, b

    class RegressionPreTrainedModel(PreTrainedModel):
        config_class = RegressionConfig
        base_model_prefix = "regression"

        def __init__(self, config):
            super().__init__(config)
            self.a = nn.Parameter(torch.tensor(float(config.a)))
            self.b = nn.Parameter(torch.tensor(float(config.b)))
            self.post_init()

        def _init_weights(self, module):
            return None

        def forward(self, input_x, labels=None, **kwargs):
            y = input_x * self.a + self.b
            if labels is None:
                return (y,)
            return (nn.functional.mse_loss(y, labels), y)

    return RegressionPreTrainedModel(RegressionConfig(a=a, b=b)), RegressionPreTrainedModel


class AlmostAccuracy:
    """transformers' ``AlmostAccuracy``: share of predictions within ``thresh``."""

    def __init__(self, thresh: float = 0.25):
        self.thresh = thresh

    def __call__(self, eval_pred):
        predictions, labels = eval_pred
        true = np.abs(predictions - labels) <= self.thresh
        return {"accuracy": true.astype(np.float32).mean().item()}


def regression_trainer(
    impl, output_dir, *, a=0, b=0, train_len=64, eval_len=64, pretrained=False, **kwargs
):
    """transformers' ``get_regression_trainer`` restated for either implementation."""
    callbacks = kwargs.pop("callbacks", None)
    compute_metrics = kwargs.pop("compute_metrics", None)
    trainer_cls = kwargs.pop("trainer_cls", impl.Trainer)
    double_output = kwargs.pop("double_output", False)
    model = pretrained_model(a, b)[0] if pretrained else RegressionModel(a, b, double_output)
    kwargs.setdefault("report_to", "none")
    kwargs.setdefault("disable_tqdm", True)
    args = impl.TrainingArguments(str(output_dir), **kwargs)
    return trainer_cls(
        model,
        args,
        train_dataset=RegressionDataset(length=train_len),
        eval_dataset=RegressionDataset(length=eval_len),
        compute_metrics=compute_metrics,
        callbacks=callbacks,
    )
