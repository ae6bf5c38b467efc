"""What transformers' published example scripts call besides ``train()``, against both
implementations (``impl``): ``HfArgumentParser`` over (model, data, training) dataclasses,
``--use_cpu``, the process properties they log (``device``, ``n_gpu``, ``parallel_mode``,
``local_process_index``, ``should_log``, ``get_process_log_level``),
``main_process_first``, and the result calls at their end (``log_metrics``,
``save_metrics``, ``create_model_card``; ``push_to_hub`` only where ``push_to_hub`` is
set). The dataclasses below are ours, shaped as the examples' ``ModelArguments`` and
``DataTrainingArguments`` are. Each test also pins that meshtrain's Trainer construction
draws nothing from the global RNG that transformers' does not.

Comparisons are exact: parsed values, printed lines and file contents are text; the
metrics printed are compared key by key between the implementations' own runs (their
values are each implementation's, so only the format and the keys are compared).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conformance.trainer.peer import regression_trainer


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "checkpoint"})
    config_overrides: str | None = None
    cache_dir: str | None = None


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = None
    max_train_samples: int | None = None
    overwrite_cache: bool = False
    validation_split_percentage: int | None = 5


ARGV = [
    "--model_name_or_path",
    "tiny",
    "--output_dir",
    "OUT",
    "--do_train",
    "--do_eval",
    "--use_cpu",
    "--report_to",
    "none",
    "--per_device_train_batch_size",
    "4",
    "--num_train_epochs",
    "2",
    "--learning_rate",
    "3e-4",
    "--label_names",
    "labels",
    "--log_level",
    "info",
    "--max_train_samples",
    "10",
]


def _parse(impl, tmp_path):
    from transformers import HfArgumentParser

    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, impl.TrainingArguments))
    argv = [str(tmp_path) if a == "OUT" else a for a in ARGV]
    return parser.parse_args_into_dataclasses(argv)


def test_hf_argument_parser_parses_the_examples_triple(impl, tmp_path):
    model_args, data_args, args = _parse(impl, tmp_path)
    assert model_args.model_name_or_path == "tiny" and data_args.max_train_samples == 10
    assert args.use_cpu is True and args.do_train and args.do_eval
    assert args.report_to == [] and args.label_names == ["labels"]
    assert args.per_device_train_batch_size == 4 and args.num_train_epochs == 2.0
    assert args.learning_rate == 3e-4 and args.output_dir == str(tmp_path)


def test_process_properties_the_examples_log(impl, tmp_path):
    """run_clm.py / run_glue.py's first lines: ``should_log``, ``get_process_log_level``,
    and the warning naming rank, device, n_gpu, distributed and fp16."""
    _, _, args = _parse(impl, tmp_path)
    assert args.should_log is True and args.should_save is True
    assert args.get_process_log_level() == logging.INFO
    line = (
        f"Process rank: {args.local_process_index}, device: {args.device}, n_gpu: "
        f"{args.n_gpu}, distributed training: {args.parallel_mode.value == 'distributed'}, "
        f"16-bits training: {args.fp16}"
    )
    assert line == (
        "Process rank: 0, device: cpu, n_gpu: 0, distributed training: False, "
        "16-bits training: False"
    )
    assert (args.world_size, args.process_index) == (1, 0)
    assert args.eval_do_concat_batches is True and args.push_to_hub is False
    ran = []
    with args.main_process_first(desc="dataset map tokenization"):
        ran.append(True)
    assert ran == [True]
    quiet = impl.TrainingArguments(str(tmp_path), log_level_replica="error")
    # the main process of one: "passive" leaves transformers' verbosity (WARNING) as set
    assert quiet.get_process_log_level() == logging.WARNING


def test_trainer_construction_draws_what_transformers_draws(impl, tmp_path):
    """Trainer(...) seeds with ``args.seed`` and draws nothing more: the global RNG state
    right after construction is ``torch.manual_seed(seed)``'s, in both libraries."""
    regression_trainer(impl, tmp_path, seed=123, report_to="none")
    after = torch.get_rng_state()
    torch.manual_seed(123)
    assert torch.equal(after, torch.get_rng_state())


def test_log_metrics_save_metrics_and_model_card(impl, tmp_path, capsys):
    """The end of every example: log_metrics (a formatted table), save_metrics
    (``train_results.json``, ``all_results.json`` merged), save_state, create_model_card
    (``README.md``)."""
    trainer = regression_trainer(impl, tmp_path, max_steps=4, save_strategy="no", pretrained=True)
    metrics = trainer.train().metrics
    metrics["train_samples"] = 64
    capsys.readouterr()
    trainer.log_metrics("train", metrics)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "***** train metrics *****"
    keys = [line.split("=")[0].strip() for line in printed[1:]]
    assert keys == sorted(metrics)
    widths = {line.index("=") for line in printed[1:]}
    assert len(widths) == 1  # the keys padded to one column
    runtime = next(line for line in printed if "train_runtime" in line)
    assert runtime.split("=")[1].strip().startswith("0:00:")  # h:mm:ss.cc
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_loss": 0.5})
    with open(os.path.join(tmp_path, "train_results.json")) as f:
        assert json.load(f) == json.loads(json.dumps(metrics))
    with open(os.path.join(tmp_path, "all_results.json")) as f:
        assert json.load(f) == {**json.loads(json.dumps(metrics)), "eval_loss": 0.5}
    text = Path(tmp_path, "train_results.json").read_text()
    assert text == json.dumps(json.loads(text), indent=4, sort_keys=True)
    trainer.create_model_card(finetuned_from="tiny", tasks="text-generation")
    card = Path(tmp_path, "README.md").read_text()
    assert "library_name: transformers" in card and "base_model: tiny" in card
    assert "generated_from_trainer" in card
    assert "- learning_rate: 5e-05" in card and "- seed: 42" in card
    assert "- train_batch_size: 8" in card and "- training_steps: 4" in card


def test_push_to_hub_is_refused_by_name(tmp_path):
    """meshtrain never uploads: the argument and the call name themselves."""
    import meshtrain
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="push_to_hub"):
        meshtrain.TrainingArguments(str(tmp_path), push_to_hub=True)
    args = meshtrain.TrainingArguments(str(tmp_path), report_to="none")
    from tests.conformance.trainer.peer import RegressionModel

    trainer = meshtrain.Trainer(RegressionModel(), args)
    with pytest.raises(ConfigError, match="Trainer.push_to_hub"):
        trainer.push_to_hub(commit_message="done")
