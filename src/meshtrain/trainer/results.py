"""What a Trainer script prints and writes about its results: transformers 5.x's
``log_metrics`` (the formatted table on stdout), ``save_metrics`` (``<split>_results.json``
and ``all_results.json``), ``create_model_card`` (``README.md``) and the refused
``push_to_hub``.

Each writes on the world's process zero only, as transformers does. The text and the
files are transformers' own: the table follows ``trainer_pt_utils.metrics_format``, the
JSON is ``json.dump(indent=4, sort_keys=True)``, and the model card is written by
transformers' ``TrainingSummary`` itself (a view of the meshtrain Trainer hands it the
attributes it reads), so a script's outputs compare byte for byte with the peer's.
"""

from __future__ import annotations

import datetime
import json
import os
import types
from typing import Any

from meshtrain.errors import ConfigError


def _secs(secs: float) -> str:
    """transformers' ``_secs2timedelta``: ``h:mm:ss.cc``."""
    cents = int(abs(secs - int(secs)) * 100)
    return f"{datetime.timedelta(seconds=int(secs))}.{cents:02d}"


def metrics_format(metrics: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``metrics_format``: memory in MB, runtimes as clock time, FLOs in GF,
    floats rounded to 4 places."""
    out = dict(metrics)
    for key, value in out.items():
        if "_mem_" in key:
            out[key] = f"{value >> 20}MB"
        elif "_runtime" in key:
            out[key] = _secs(value)
        elif key == "total_flos":
            out[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            out[key] = round(value, 4)
    return out


def log_metrics(split: str, metrics: dict[str, Any], main: bool) -> None:
    """Print ``***** <split> metrics *****`` and one aligned ``key = value`` line per
    metric, sorted by key (rank 0 only)."""
    if not main:
        return
    print(f"***** {split} metrics *****")
    shown = metrics_format(metrics)
    k_width = max(len(str(k)) for k in shown)
    v_width = max(len(str(v)) for v in shown.values())
    for key in sorted(shown):
        print(f"  {key: <{k_width}} = {shown[key]:>{v_width}}")


def save_metrics(
    output_dir: str, split: str, metrics: dict[str, Any], main: bool, combined: bool = True
) -> None:
    """``<split>_results.json``; with ``combined`` also merged into ``all_results.json``."""
    if not main:
        return
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"{split}_results.json"), "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=4, sort_keys=True)
    if combined:
        path = os.path.join(output_dir, "all_results.json")
        merged: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                merged = json.load(f)
        merged.update(metrics)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(merged, f, indent=4, sort_keys=True)


def _args_view(args: Any) -> types.SimpleNamespace:
    """The TrainingArguments attributes transformers' model card reads, with its enum
    types (``lr_scheduler_type.value``, ``parallel_mode`` compared with its ParallelMode)."""
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import ParallelMode

    names = [
        "output_dir",
        "learning_rate",
        "train_batch_size",
        "eval_batch_size",
        "seed",
        "world_size",
        "gradient_accumulation_steps",
        "optim",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "warmup_steps",
        "max_steps",
        "num_train_epochs",
        "fp16",
    ]
    view = types.SimpleNamespace(**{n: getattr(args, n) for n in names})
    view.optim_args = None
    view.label_smoothing_factor = 0.0
    view.lr_scheduler_type = SchedulerType(args.lr_scheduler_type)
    view.parallel_mode = ParallelMode(args.parallel_mode.value)
    return view


def create_model_card(trainer: Any, **card: Any) -> None:
    """``README.md`` in ``output_dir``, written by transformers' ``TrainingSummary`` from
    the trainer's arguments, log history, model and datasets (transformers' contract:
    ``language``, ``license``, ``tags``, ``model_name``, ``finetuned_from``, ``tasks``,
    ``dataset_tags``, ``dataset``, ``dataset_args``)."""
    if not trainer.is_world_process_zero():
        return
    try:
        from huggingface_hub import ModelCard
        from transformers.modelcard import TrainingSummary
    except ImportError as exc:
        raise ConfigError(
            f"Trainer.create_model_card needs transformers (and huggingface_hub): {exc}; "
            "pip install transformers"
        ) from None
    path = os.path.join(trainer.args.output_dir, "README.md")
    tags = card.get("tags")
    if os.path.exists(path):  # transformers keeps the tags a card already has
        existing = ModelCard.load(path).data.tags
        if tags is not None and existing is not None:
            tags = [tags] if isinstance(tags, str) else list(tags)
            tags += [t for t in existing if t not in tags]
            card["tags"] = tags
    view = types.SimpleNamespace(
        args=_args_view(trainer.args),
        state=trainer.state,
        model=trainer.model,
        train_dataset=trainer.train_dataset,
        eval_dataset=trainer.eval_dataset,
    )
    summary = TrainingSummary.from_trainer(view, **card)
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(summary.to_model_card())


def refuse_push(what: str) -> None:
    """meshtrain never uploads: say so by name, with the way to do it by hand."""
    raise ConfigError(
        f"{what}: meshtrain does not upload to the Hugging Face Hub (training runs "
        "offline); upload output_dir yourself (`hf upload <repo> <output_dir>`), and call "
        "create_model_card() for its README.md"
    )


__all__ = ["create_model_card", "log_metrics", "metrics_format", "refuse_push", "save_metrics"]
