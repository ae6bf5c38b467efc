"""``TrainingArguments``: the transformers names and defaults, checked once, mapped onto
meshtrain's engine config.

The fields are the ones users type into transformers' ``TrainingArguments`` (5.x names and
defaults), plus the older ``evaluation_strategy`` that transformers removed but every
tutorial still uses, and meshtrain's ``mesh``. A bad value raises one ``ConfigError``
naming the field, the value and the fix, before any process group or model is touched.

``to_engine_config(...)`` builds the dict ``meshtrain.initialize`` takes. With
``deepspeed=`` (a DeepSpeed/meshtrain JSON or YAML path, or a dict) that config is the
base: its ``"auto"`` values are filled from these arguments, as the transformers
DeepSpeed integration does, and a number written there that contradicts an argument is
an error rather than a silent winner.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.trainer.checks import (
    check_bools,
    check_liger,
    check_names,
    choice,
    is_int,
    metrics_inputs,
    positive,
)
from meshtrain.trainer.process_arguments import ProcessArguments

STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
# transformers optim name -> meshtrain optimizer type (docs/optimizers.md). transformers'
# "adafactor" is its own Adafactor class; here it is torch.optim.Adafactor.
OPTIMIZERS = {
    "adafactor": "Adafactor",
    "adamw_bnb_8bit": "AdamW8bit",
    "adamw_8bit": "AdamW8bit",
    "lion_32bit": "Lion",
    "lion_8bit": "Lion8bit",
    "adamw_torch": "AdamW",
    "adamw_torch_fused": "AdamW",
    "adamw_hf": "AdamW",
    "adamw": "AdamW",
    "adam": "Adam",
    "sgd": "SGD",
    "adagrad": "Adagrad",
}
REPORTERS = ("tensorboard", "jsonl", "none", "all")


@dataclass
class TrainingArguments(ProcessArguments):
    """The arguments of :class:`~meshtrain.trainer.Trainer`, as in transformers.

    Everything a seed script passes to ``transformers.TrainingArguments`` is accepted with
    the same meaning and default; see docs/trainer.md for what differs. meshtrain-only:
    ``mesh`` (``{"tensor_parallel_size": ..., "pipeline_parallel_size": ...}``) and
    ``deepspeed`` accepting any meshtrain config key (ZeRO stage, offload, ...).
    """

    output_dir: str | None = None
    overwrite_output_dir: bool = False
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    warmup_ratio: float | None = None
    optim: str = "adamw_torch_fused"
    logging_dir: str | None = None
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    logging_nan_inf_filter: bool = True
    """A step whose loss on this process is NaN or inf is logged as the mean of its steps
    since the last log (transformers' filter; training itself is unchanged)."""
    eval_strategy: str = "no"
    evaluation_strategy: str | None = None
    eval_steps: float | None = None
    eval_delay: float = 0
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    load_best_model_at_end: bool = False
    fp16: bool = False
    bf16: bool = False
    gradient_checkpointing: bool | None = None
    torch_compile: bool = False
    use_liger_kernel: bool = False
    """transformers' switch for Liger-Kernel: its fused linear cross-entropy becomes
    meshtrain's chunked loss (``loss.chunked``); its other kernels are not applied (said
    at construction)."""
    liger_kernel_config: dict | None = None
    seed: int = 42
    data_seed: int | None = None
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    prediction_loss_only: bool = False
    average_tokens_across_devices: bool = True
    """How a data-parallel step weighs its ranks: by the label items of the whole step over
    every rank (True: the mean over the global batch), or each rank by its own items and
    then the mean over ranks (False). transformers gets True's meaning only for models
    whose loss takes ``num_items_in_batch`` (docs/trainer.md, "Losses over processes")."""
    include_for_metrics: list[str] = dataclasses.field(default_factory=list)
    """What ``compute_metrics`` gets besides predictions and labels: "inputs" (the model's
    main input), "loss" (each row's batch loss), as ``EvalPrediction.inputs`` / ``.losses``."""
    include_inputs_for_metrics: bool = False  # transformers' older name for ["inputs"]
    # None first, then str: HfArgumentParser's isinstance() cannot take list[str] there
    report_to: None | str | list[str] = "none"
    run_name: str | None = None
    disable_tqdm: bool | None = None
    resume_from_checkpoint: str | None = None
    restore_callback_states_from_checkpoint: bool = False
    deepspeed: dict | str | None = None  # transformers' order: HfArgumentParser types it str
    use_cache: bool = False  # set as model.config.use_cache (a cache hides packed documents)
    padding_free: bool = False  # TRL's name: FlatteningCollator when no collator is given
    mesh: dict | None = None
    """meshtrain: ``{"tensor_parallel_size": t, "pipeline_parallel_size": p}``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingArguments:
        # runs before the dataclass __init__, whose bare TypeError names no close match
        check_names(kwargs, [f.name for f in dataclasses.fields(cls)])
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.evaluation_strategy is not None:  # the name the seeds and tutorials use
            if self.eval_strategy not in ("no", self.evaluation_strategy):
                raise ConfigError(
                    f"TrainingArguments: evaluation_strategy={self.evaluation_strategy!r} and "
                    f"eval_strategy={self.eval_strategy!r} disagree; pass only one "
                    "(evaluation_strategy is the older name of eval_strategy)"
                )
            self.eval_strategy = self.evaluation_strategy
        if self.output_dir is None:
            self.output_dir = "trainer_output"  # transformers 5's default
        self.output_dir = os.fspath(self.output_dir)
        self.eval_strategy = choice("eval_strategy", self.eval_strategy, STRATEGIES)
        self.evaluation_strategy = self.eval_strategy
        self.logging_strategy = choice("logging_strategy", self.logging_strategy, STRATEGIES)
        self.save_strategy = choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        self.lr_scheduler_type = choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS)
        self.optim = choice("optim", self.optim, tuple(OPTIMIZERS))
        check_bools(self)
        self.include_for_metrics = metrics_inputs(
            self.include_for_metrics, self.include_inputs_for_metrics
        )
        check_liger(self.liger_kernel_config, self.use_liger_kernel)
        for name in ("seed", "data_seed"):
            value = getattr(self, name)
            if not (value is None and name == "data_seed") and not is_int(value):
                raise ConfigError(
                    f"TrainingArguments.{name}: {value!r} is not allowed; use an integer"
                )
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            positive(name, getattr(self, name), integer=True)
        positive("gradient_accumulation_steps", self.gradient_accumulation_steps, integer=True)
        positive(
            "dataloader_num_workers", self.dataloader_num_workers, allow_zero=True, integer=True
        )
        nonnegative = ("learning_rate", "weight_decay", "adam_epsilon", "max_grad_norm")
        for name in (*nonnegative, "num_train_epochs", "warmup_steps"):
            positive(name, getattr(self, name), allow_zero=True)
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 <= value < 1:
                raise ConfigError(f"TrainingArguments.{name}: {value!r} must be in [0, 1)")
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio <= 1:
            raise ConfigError(
                f"TrainingArguments.warmup_ratio: {self.warmup_ratio!r} must be in [0, 1]"
            )
        if not isinstance(self.max_steps, int) or isinstance(self.max_steps, bool):
            raise ConfigError(f"TrainingArguments.max_steps: {self.max_steps!r} is not an integer")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ConfigError(
                "TrainingArguments: max_steps <= 0 and num_train_epochs <= 0 leave nothing to "
                "train; set num_train_epochs > 0 or max_steps > 0"
            )
        if self.fp16 and self.bf16:
            raise ConfigError("TrainingArguments: fp16 and bf16 are both True; enable at most one")
        if self.save_total_limit is not None:
            positive("save_total_limit", self.save_total_limit, integer=True)
        if self.logging_strategy == "steps":
            positive("logging_steps", self.logging_steps)
        if self.save_strategy == "steps":
            positive("save_steps", self.save_steps)
        if self.eval_strategy == "steps":
            if self.eval_steps is None:
                self.eval_steps = self.logging_steps  # transformers' rule
            positive("eval_steps", self.eval_steps)
        self.report_to = self._reporters(self.report_to)
        self.check_process_fields()
        if isinstance(self.label_names, str):
            self.label_names = [self.label_names]
        self._check_best_model()
        if self.mesh is not None:
            from meshtrain.config import Config

            if not isinstance(self.mesh, dict):
                raise ConfigError(
                    f"TrainingArguments.mesh: {self.mesh!r} is not allowed; pass a dict such "
                    'as {"tensor_parallel_size": 2}'
                )
            try:  # the config's own messages: "mesh.tp: unknown key; valid keys: ..."
                Config.from_dict({"mesh": self.mesh})
            except ConfigError as exc:
                raise ConfigError(f"TrainingArguments.{exc}") from None

    def _reporters(self, value: Any) -> list[str]:
        items = [value] if value is None or isinstance(value, str) else list(value)
        out = []
        for item in items:
            name = "none" if item is None else choice("report_to", item, REPORTERS)
            out += ["tensorboard", "jsonl"] if name == "all" else [name]
        return [] if "none" in out else out

    def _check_best_model(self) -> None:
        if self.save_strategy == "best" and self.eval_strategy == "no":
            # "best" saves after an evaluation that improves the metric: none would happen
            raise ConfigError(
                'TrainingArguments.save_strategy "best" saves after an evaluation that '
                'improves metric_for_best_model, but eval_strategy is "no", so nothing would '
                'ever be saved; set eval_strategy to "steps" or "epoch"'
            )
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.load_best_model_at_end:
            if self.save_strategy != "best" and self.eval_strategy != self.save_strategy:
                raise ConfigError(
                    "TrainingArguments.load_best_model_at_end needs evaluations where "
                    f"checkpoints are saved: eval_strategy={self.eval_strategy!r} but "
                    f"save_strategy={self.save_strategy!r}; make them equal"
                )
            if self.eval_strategy == "no":
                raise ConfigError(
                    "TrainingArguments.load_best_model_at_end needs an evaluation; set "
                    'eval_strategy to "steps" or "epoch"'
                )
            if self.eval_strategy == "steps" and self.save_strategy == "steps":
                if self.save_steps % self.eval_steps:
                    raise ConfigError(
                        f"TrainingArguments.save_steps {self.save_steps} must be a multiple "
                        f"of eval_steps {self.eval_steps} with load_best_model_at_end, so "
                        "every checkpoint has an evaluation"
                    )
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            name = self.metric_for_best_model
            self.greater_is_better = not name.endswith("loss")

    # -- derived values -------------------------------------------------------------------
    @property
    def metric_key(self) -> str | None:
        """The metrics key of ``metric_for_best_model`` (``"f1"`` -> ``"eval_f1"``)."""
        m = self.metric_for_best_model
        return None if m is None else (m if m.startswith("eval_") else f"eval_{m}")

    def warmup_for(self, total_steps: int) -> int:
        """Warmup steps: ``warmup_steps`` (a fraction of ``total_steps`` when < 1, as in
        transformers 5), else ``warmup_ratio * total_steps`` rounded up."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        ratio = self.warmup_steps if self.warmup_steps > 0 else (self.warmup_ratio or 0.0)
        return int(-(-ratio * total_steps // 1))

    @property
    def chunked_loss(self) -> bool:
        """``use_liger_kernel`` with its fused linear cross-entropy (on unless the config
        turns it off): the LM head and the loss computed in chunks (``loss.chunked``)."""
        cfg = self.liger_kernel_config or {}
        return self.use_liger_kernel and cfg.get("fused_linear_cross_entropy", True)

    def to_dict(self) -> dict[str, Any]:
        """The arguments as a JSON-serialisable dict (saved with each checkpoint)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "deepspeed" or not isinstance(self.deepspeed, dict)
        }

    def to_engine_config(
        self, total_steps: int | None = None, world_size: int | None = None
    ) -> dict[str, Any]:
        """The config dict for ``meshtrain.initialize`` (see the module docstring).

        ``world_size`` (the processes of the run; default: the mesh's model-parallel size,
        i.e. one data-parallel rank) checks batch sizes and the mesh against the run.

        The optimizer is built by the engine from ``optim`` unless the DeepSpeed config has
        its own ``optimizer`` section; the learning-rate schedule is the Trainer's own
        (``lr_scheduler_type``) unless that config has a ``scheduler`` section.
        """
        from meshtrain.config import load_config

        base = self._deepspeed_dict()
        filled = {
            "train_micro_batch_size_per_gpu": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_clipping": self.max_grad_norm,
            "fp16.enabled": self.fp16,
            "bf16.enabled": self.bf16,
            "optimizer.params.lr": self.learning_rate,
            "optimizer.params.betas": [self.adam_beta1, self.adam_beta2],
            "optimizer.params.eps": self.adam_epsilon,
            "optimizer.params.weight_decay": self.weight_decay,
            "scheduler.params.warmup_max_lr": self.learning_rate,
        }
        if total_steps is not None:  # a DeepSpeed scheduler section's "auto" step counts
            filled["scheduler.params.total_num_steps"] = total_steps
            filled["scheduler.params.warmup_num_steps"] = self.warmup_for(total_steps)
        for key, value in filled.items():
            written = _get(base, key)
            if written is None or written == "auto":
                continue
            if key.startswith(("optimizer.", "scheduler.")):
                continue  # the DeepSpeed config's own optimizer/schedule wins, as in transformers
            if key.endswith(".enabled") and not value:
                continue  # precision enabled by the config alone is fine
            if written != value:
                raise ConfigError(
                    f"deepspeed config {key} = {written!r} contradicts TrainingArguments "
                    f'({_arg_name(key)} = {value!r}); write "auto" there or make them equal'
                )
        config = dict(base)
        config.setdefault("train_micro_batch_size_per_gpu", self.per_device_train_batch_size)
        config.setdefault("gradient_accumulation_steps", self.gradient_accumulation_steps)
        config.setdefault("gradient_clipping", self.max_grad_norm)
        if base.get("train_batch_size") == "auto":
            config.pop("train_batch_size")
        if self.fp16:
            config["fp16"] = {**config.get("fp16", {}), "enabled": True}
        if self.bf16:
            config["bf16"] = {**config.get("bf16", {}), "enabled": True}
        if "optimizer" not in config:
            config["optimizer"] = self.optimizer_section()
        if self.mesh:
            config["mesh"] = {**config.get("mesh", {}), **self.mesh}
        if self.gradient_checkpointing:
            config["activation_checkpointing"] = {
                **config.get("activation_checkpointing", {}),
                "enabled": True,
            }
        if self.torch_compile:
            config["compile"] = {**config.get("compile", {}), "enabled": True}
        if self.chunked_loss:  # Liger's fused linear cross-entropy, meshtrain's way
            config["loss"] = {**config.get("loss", {}), "chunked": True}
        config.setdefault("steps_per_print", 10**9)  # the Trainer logs; the engine stays quiet
        mesh = config.get("mesh", {})
        model_parallel = int(mesh.get("tensor_parallel_size", 1)) * int(
            mesh.get("pipeline_parallel_size", 1)
        )
        cfg = load_config(config, world_size=world_size or model_parallel)
        cfg = cfg.resolve_auto({k: v for k, v in filled.items()})
        return cfg.to_dict(derived=False)

    def optimizer_section(self) -> dict[str, Any]:
        """The engine config's ``optimizer`` section for ``optim`` and its settings
        (meshtrain's; ``Trainer.create_optimizer`` builds from it)."""
        kind = OPTIMIZERS[self.optim]
        params: dict[str, Any] = {"lr": self.learning_rate, "weight_decay": self.weight_decay}
        if kind in ("Adam", "AdamW", "AdamW8bit"):
            params.update(betas=[self.adam_beta1, self.adam_beta2], eps=self.adam_epsilon)
        if self.optim == "adamw_torch_fused":  # torch's fused kernel, on CPU too (transformers)
            params["fused"] = True
        if kind in ("Lion", "Lion8bit"):  # transformers passes Adam's betas to Lion
            params["betas"] = [self.adam_beta1, self.adam_beta2]
        if kind == "Adagrad":
            params["eps"] = self.adam_epsilon
        return {"type": kind, "params": params}

    def _deepspeed_dict(self) -> dict[str, Any]:
        ds = self.deepspeed
        if ds is None:
            return {}
        if isinstance(ds, dict):
            return dict(ds)
        if isinstance(ds, str | os.PathLike):
            from meshtrain.config import read_config_file

            try:
                return dict(read_config_file(ds))
            except ConfigError as exc:
                raise ConfigError(f"TrainingArguments.deepspeed: {exc}") from None
        raise ConfigError(
            f"TrainingArguments.deepspeed: {type(ds).__name__} is not allowed; pass a path "
            "to a JSON/YAML config or a dict"
        )


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _arg_name(key: str) -> str:
    return {
        "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "gradient_clipping": "max_grad_norm",
        "fp16.enabled": "fp16",
        "bf16.enabled": "bf16",
    }.get(key, key)


__all__ = ["OPTIMIZERS", "SCHEDULERS", "TrainingArguments"]
