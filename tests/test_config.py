"""Tests of meshtrain.config: DeepSpeed-compatible loading, errors, batch sizes and "auto".

Pure Python (no torch.distributed): every test runs in milliseconds.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from meshtrain.config import (
    AUTO_DEFAULTS,
    BATCH_KEYS,
    Config,
    config_reference_markdown,
    derive_batch_sizes,
    detect_world_size,
    load_config,
)
from meshtrain.config.__main__ import main as config_cli
from meshtrain.config.optimizer import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from meshtrain.config.resolve import auto_default_values
from meshtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "data" / "configs"
DATA_FILES = sorted(p for p in CONFIGS.iterdir() if p.suffix in (".json", ".yaml", ".yml"))


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The world size must come from the test, not from whatever launched pytest."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)


# ----------------------------------------------------------------------------- bad configs

# (id, config, load_config kwargs, substrings the message must contain)
BAD_CONFIGS: list[tuple[str, dict, dict, tuple[str, ...]]] = [
    (
        "top-typo",
        {"zero_optimisation": {"stage": 2}},
        {},
        ("zero_optimisation: unknown key", "did you mean zero_optimization?"),
    ),
    (
        "nested-typo",
        {"zero_optimization": {"offload_optimizer": {"devices": "cpu"}}},
        {},
        ("zero_optimization.offload_optimizer.devices: unknown key", "did you mean device?"),
    ),
    (
        "case-typo",
        {"Train_Batch_Size": 8},
        {},
        ("Train_Batch_Size: unknown key", "did you mean train_batch_size?"),
    ),
    (
        "fp16-typo",
        {"fp16": {"loss_scale_windows": 100}},
        {},
        ("fp16.loss_scale_windows", "did you mean loss_scale_window?"),
    ),
    (
        "mesh-typo",
        {"mesh": {"tensor_paralel_size": 2}},
        {},
        ("mesh.tensor_paralel_size", "did you mean tensor_parallel_size?"),
    ),
    (
        "tensorboard-typo",
        {"tensorboard": {"output": "runs"}},
        {},
        ("tensorboard.output", "did you mean output_path?"),
    ),
    ("renamed-bfloat16", {"bfloat16": {"enabled": True}}, {}, ("bfloat16: unknown key", "bf16")),
    (
        "renamed-fp16-gather",
        {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}},
        {},
        (
            "zero_optimization.stage3_gather_fp16_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
        ),
    ),
    (
        "stage-4",
        {"zero_optimization": {"stage": 4}},
        {},
        ("zero_optimization.stage: 4 is not allowed; use 0, 1, 2 or 3",),
    ),
    (
        "stage-bool",
        {"zero_optimization": {"stage": True}},
        {},
        ("zero_optimization.stage: true is not allowed",),
    ),
    (
        "stage-fraction",
        {"zero_optimization": {"stage": 2.5}},
        {},
        ("zero_optimization.stage: 2.5",),
    ),
    (
        "section-not-mapping",
        {"zero_optimization": 2},
        {},
        ("zero_optimization: 2 is not allowed", "mapping"),
    ),
    (
        "micro-word",
        {"train_micro_batch_size_per_gpu": "eight"},
        {},
        ('train_micro_batch_size_per_gpu: "eight" is not allowed', '"auto"'),
    ),
    (
        "micro-fraction",
        {"train_micro_batch_size_per_gpu": 1.5},
        {},
        ("train_micro_batch_size_per_gpu: 1.5", "an integer > 0"),
    ),
    (
        "micro-zero",
        {"train_micro_batch_size_per_gpu": 0},
        {},
        ("train_micro_batch_size_per_gpu: 0 is not allowed",),
    ),
    (
        "auto-capitalised",
        {"gradient_accumulation_steps": "Auto"},
        {},
        ('gradient_accumulation_steps: "Auto"',),
    ),
    (
        "clipping-negative",
        {"gradient_clipping": -1},
        {},
        ("gradient_clipping: -1 is not allowed", ">= 0"),
    ),
    ("steps-null", {"steps_per_print": None}, {}, ("steps_per_print: null",)),
    ("bool-as-int", {"wall_clock_breakdown": 1}, {}, ("wall_clock_breakdown: 1", "true or false")),
    (
        "optimizer-unknown",
        {"optimizer": {"type": "Lamb", "params": {}}},
        {},
        ("optimizer.type", "Lamb", "Adam, AdamW, SGD, Adagrad, Adafactor, AdamW8bit, Lion"),
    ),
    (
        "optimizer-no-type",
        {"optimizer": {"params": {"lr": 1e-3}}},
        {},
        ("optimizer.type: missing",),
    ),
    (
        "optimizer-foreign-param",
        {"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}},
        {},
        ("optimizer.params.betas: unknown key",),
    ),
    (
        "optimizer-param-typo",
        {"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
        {},
        ("optimizer.params.weight_decy", "did you mean weight_decay?"),
    ),
    (
        "betas-one",
        {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
        {},
        ("optimizer.params.betas: [0.9]", "2 numbers"),
    ),
    (
        "betas-range",
        {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}},
        {},
        ("optimizer.params.betas",),
    ),
    (
        "lr-negative",
        {"optimizer": {"type": "adam", "params": {"lr": -1}}},
        {},
        ("optimizer.params.lr: -1",),
    ),
    (
        "adamw-not-decoupled",
        {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
        {},
        ("optimizer.params.adam_w_mode",),
    ),
    (
        "nesterov-no-momentum",
        {"optimizer": {"type": "SGD", "params": {"nesterov": True}}},
        {},
        ("optimizer.params.nesterov",),
    ),
    (
        "params-not-mapping",
        {"optimizer": {"type": "Adam", "params": "fast"}},
        {},
        ("optimizer.params",),
    ),
    (
        "scheduler-unknown",
        {"scheduler": {"type": "OneCycle", "params": {}}},
        {},
        ("scheduler.type", "WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ),
    (
        "scheduler-missing-total",
        {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3}}},
        {},
        ("scheduler.params.total_num_steps: missing",),
    ),
    (
        "scheduler-warmup-type",
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
        {},
        ("scheduler.params.warmup_type", '"log" or "linear"'),
    ),
    (
        "cosine-ratio",
        {
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 10, "cos_min_ratio": 2},
            }
        },
        {},
        ("scheduler.params.cos_min_ratio: 2",),
    ),
    (
        "fp16-and-bf16",
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        {},
        ("fp16.enabled", "bf16.enabled"),
    ),
    ("fp16-enabled-yes", {"fp16": {"enabled": "yes"}}, {}, ('fp16.enabled: "yes"',)),
    ("min-loss-scale-zero", {"fp16": {"min_loss_scale": 0}}, {}, ("fp16.min_loss_scale: 0",)),
    ("amp-enabled", {"amp": {"enabled": True}}, {}, ("amp.enabled", "fp16")),
    (
        "offload-nvme",
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        {},
        ('zero_optimization.offload_param.device: "nvme"', '"none" or "cpu"'),
    ),
    (
        "offload-param-stage2",
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        {},
        ("zero_optimization.offload_param", "stage 3"),
    ),
    (
        "offload-optimizer-stage0",
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        {},
        ("zero_optimization.offload_optimizer", "stage"),
    ),
    (
        "bucket-fraction",
        {"zero_optimization": {"reduce_bucket_size": 5.5e8 + 0.5}},
        {},
        ("zero_optimization.reduce_bucket_size",),
    ),
    (
        "module-classes-string",
        {"activation_checkpointing": {"module_classes": "Block"}},
        {},
        ("activation_checkpointing.module_classes", "a list of strings"),
    ),
    ("keep-last-zero", {"checkpoint": {"keep_last": 0}}, {}, ("checkpoint.keep_last: 0",)),
    (
        "tag-validation",
        {"checkpoint": {"tag_validation": "loud"}},
        {},
        ("checkpoint.tag_validation", '"Ignore", "Warn" or "Fail"'),
    ),
    ("compile-mode", {"compile": {"mode": "fastest"}}, {}, ("compile.mode",)),
    (
        "timeout-zero",
        {"distributed": {"timeout_minutes": 0}},
        {},
        ("distributed.timeout_minutes: 0",),
    ),
    (
        "backend-mpi",
        {"distributed": {"backend": "mpi"}},
        {},
        ("distributed.backend", '"auto", "gloo" or "nccl"'),
    ),
    (
        "batch-inconsistent",
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        {"world_size": 2},
        (
            "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 * data-parallel size 2 = 16",
        ),
    ),
    (
        "batch-indivisible",
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        {"world_size": 2},
        (
            "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 * data-parallel size 2 = 8",
        ),
    ),
    (
        "batch-tbs-only-indivisible",
        {"train_batch_size": 7},
        {"world_size": 2},
        ("train_batch_size 7 is not divisible by data-parallel size 2",),
    ),
    (
        "mesh-does-not-fit",
        {"mesh": {"tensor_parallel_size": 4}},
        {"world_size": 6},
        ("world size 6", "mesh.tensor_parallel_size 4"),
    ),
    ("world-size-zero", {}, {"world_size": 0}, ("world_size 0",)),
]


@pytest.mark.parametrize(
    ("config", "kwargs", "expected"),
    [pytest.param(c, k, e, id=i) for i, c, k, e in BAD_CONFIGS],
)
def test_bad_config_names_the_path(config: dict, kwargs: dict, expected: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert "pydantic" not in message.lower() and "validation error" not in message.lower()


def test_there_are_at_least_30_distinct_bad_configs() -> None:
    assert len({json.dumps(c, sort_keys=True) for _, c, _, _ in BAD_CONFIGS}) >= 30


def test_bad_config_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    with pytest.raises(ConfigError, match=r"ds\.json: zero_optimization\.stage: 7 is not allowed"):
        load_config(path)


def test_several_problems_are_all_reported() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"fp16": {"enabled": "on"}, "zero_optimization": {"stage": 9}})
    assert "fp16.enabled" in str(info.value) and "zero_optimization.stage" in str(info.value)


# ----------------------------------------------------------------------------- files


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.json: no such config file"):
        load_config(tmp_path / "nope.json")


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true}\n  "bf16": {}\n}\n')
    with pytest.raises(ConfigError, match=r"broken\.json: invalid JSON at line 4, column 3"):
        load_config(path)


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("fp16:\n  enabled: true\n bf16: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: invalid YAML at line 3"):
        load_config(str(path))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="list.json: the top level must be a JSON mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="pass a dict"):
        load_config([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("name, text", [("empty.yml", "# nothing\n"), ("empty.json", " \n")])
def test_empty_config_file_is_an_error_in_yaml_and_json(tmp_path: Path, name, text) -> None:
    """Issue 18: an empty YAML used to load as all defaults while empty JSON failed."""
    path = tmp_path / name
    path.write_text(text)
    kind = "YAML" if name.endswith("yml") else "JSON"
    with pytest.raises(ConfigError, match=rf"{name}: the {kind} config file is empty; .*{{}}"):
        load_config(path)
    (tmp_path / "defaults.yml").write_text("{}\n")
    assert load_config(tmp_path / "defaults.yml") == load_config({})


# ----------------------------------------------------------------------------- real configs


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: p.name)
def test_real_world_configs_load_and_round_trip(path: Path) -> None:
    config = load_config(path, world_size=8)
    data = config.to_dict()
    json.dumps(data)  # JSON-serialisable
    assert load_config(data, world_size=8) == config
    assert load_config(config) is config


def test_transformers_zero3_example_auto_values() -> None:
    config = load_config(CONFIGS / "hf_zero3_auto.json")
    assert config.zero_optimization.stage == 3
    assert config.zero_optimization.offload_param.device == "cpu"
    assert config.zero_optimization.sub_group_size == 1_000_000_000  # written 1e9
    assert config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert set(config.auto_paths()) == {
        *BATCH_KEYS,
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "fp16.enabled",
        "bf16.enabled",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    }
    assert config.precision == "fp32"  # unfilled "auto" counts as disabled


def test_transformers_zero2_example() -> None:
    config = load_config(CONFIGS / "hf_zero2_auto.json")
    z = config.zero_optimization
    assert (z.stage, z.allgather_bucket_size, z.reduce_bucket_size) == (2, 200_000_000, 200_000_000)
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert config.scheduler.type == "WarmupLR" and config.optimizer.type == "AdamW"
    assert config.steps_per_print == 2000


def test_chatglm_ptuning_config() -> None:
    config = load_config(CONFIGS / "chatglm_ptuning_zero2.json")
    assert config.train_micro_batch_size_per_gpu == "auto"
    assert config.train_batch_size is None  # not resolved while the micro batch is "auto"
    assert config.zero_allow_untested_optimizer is True
    fp16 = config.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power) == ("auto", 0.0, 16)
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 1.0)
    z = config.zero_optimization
    assert z.allgather_bucket_size == 500_000_000 and isinstance(z.allgather_bucket_size, int)
    assert (z.overlap_comm, z.contiguous_gradients, z.reduce_scatter) == (False, True, True)
    filled = config.resolve_auto({"train_micro_batch_size_per_gpu": 4, "fp16.enabled": True})
    resolved = filled.resolve_batch_sizes(2)
    assert (resolved.train_batch_size, resolved.gradient_accumulation_steps) == (8, 1)
    assert resolved.precision == "fp16"


def test_yaml_config_with_mesh() -> None:
    config = load_config(CONFIGS / "zero3_bf16_3d.yaml", world_size=8)
    assert config.precision == "bf16"
    assert config.mesh.pipeline_parallel_size == 2 and config.mesh.tensor_parallel_size == 2
    # dp = 8 / (2 * 2) = 2: 64 = 4 * gas * 2
    assert config.gradient_accumulation_steps == 8
    assert config.zero_optimization.reduce_bucket_size == 500_000_000  # YAML string "5e8"
    assert config.optimizer.type == "AdamW" and config.optimizer.params.betas == (0.9, 0.95)
    assert config.scheduler.params.warmup_type == "linear"
    assert config.activation_checkpointing.module_classes == ["DecoderBlock"]
    assert config.distributed.timeout_minutes == 10.0 and config.distributed.backend == "auto"
    assert config.checkpoint.keep_last == 3
    assert config.auto_paths() == []  # backend "auto" is a choice, not a placeholder


def test_kitchen_sink_accepts_ignored_deepspeed_keys() -> None:
    config = load_config(CONFIGS / "kitchen_sink_zero1.json", world_size=4)
    assert config.precision == "fp16" and config.fp16.max_overflow_steps_at_min == 20
    assert config.optimizer.type == "SGD" and config.scheduler.type == "WarmupDecayLR"
    assert config.checkpoint.tag_validation == "Fail"
    assert config.flops_profiler["profile_step"] == 1
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (16, 2)


# ----------------------------------------------------------------------------- values


def test_integral_floats_and_numeric_strings_are_integers() -> None:
    config = load_config(
        {"zero_optimization": {"reduce_bucket_size": 2e8, "allgather_bucket_size": "5e8"}}
    )
    assert config.zero_optimization.reduce_bucket_size == 200_000_000
    assert type(config.zero_optimization.allgather_bucket_size) is int


def test_optimizer_type_is_canonical_and_adam_is_decoupled_by_default() -> None:
    assert load_config({"optimizer": {"type": "adamw"}}).optimizer.type == "AdamW"
    adam = load_config({"optimizer": {"type": "ADAM", "params": {"weight_decay": 0.1}}}).optimizer
    assert adam.type == "Adam" and adam.decoupled_weight_decay
    coupled = load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert not coupled.optimizer.decoupled_weight_decay
    assert not load_config({"optimizer": {"type": "sgd"}}).optimizer.decoupled_weight_decay
    assert load_config({"optimizer": {"type": "Adagrad"}}).optimizer.params.eps == 1e-10


def test_deepspeed_defaults() -> None:
    config = load_config({})
    assert config.precision == "fp32"
    assert config.zero_optimization.stage == 0
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.fp16.initial_scale_power == 16 and config.fp16.loss_scale_window == 1000
    assert config.gradient_clipping == 0.0 and config.steps_per_print == 10
    assert config.distributed.timeout_minutes == 5.0
    scheduler = load_config({"scheduler": {"type": "warmuplr"}}).scheduler
    assert scheduler.type == "WarmupLR"
    assert (scheduler.params.warmup_max_lr, scheduler.params.warmup_num_steps) == (None, 1000)
    assert scheduler.params.warmup_type == "log"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_defaults_to_true_at_every_stage(stage: int) -> None:
    """meshtrain overlaps reduction with backward by default at every stage (DeepSpeed only
    at stage 3); an explicit false is kept and acts (tests/distributed/test_config_keys)."""
    assert load_config({"zero_optimization": {"stage": stage}}).zero_optimization.overlap_comm
    off = {"zero_optimization": {"stage": stage, "overlap_comm": False}}
    assert load_config(off).zero_optimization.overlap_comm is False


def test_precision_property() -> None:
    assert load_config({"bf16": {"enabled": True}}).precision == "bf16"
    assert load_config({"fp16": {"enabled": True}}).precision == "fp16"
    assert (
        load_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}).precision == "fp32"
    )


def test_assignment_is_validated_with_config_errors() -> None:
    config = load_config({"optimizer": {"type": "Adam"}})
    with pytest.raises(ConfigError, match="zero_optimization.stage: 5 is not allowed"):
        config.zero_optimization.stage = 5
    with pytest.raises(ConfigError, match="optimizer.params.lr: -2"):
        config.optimizer.params.lr = -2
    with pytest.raises(ConfigError, match="fp16.enabeld: unknown key; did you mean enabled"):
        config.fp16.enabeld = True
    config.zero_optimization.stage = 2
    assert config.zero_optimization.stage == 2


def test_to_dict_keeps_what_was_written_plus_resolved_values() -> None:
    config = load_config(
        {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}, world_size=2
    )
    assert config.to_dict() == {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": True},
    }


_sections = st.fixed_dictionaries(
    {},
    optional={
        "train_micro_batch_size_per_gpu": st.integers(1, 8) | st.just("auto"),
        "gradient_accumulation_steps": st.integers(1, 4),
        "gradient_clipping": st.floats(0, 10) | st.just("auto"),
        "fp16": st.fixed_dictionaries(
            {},
            optional={
                "enabled": st.booleans() | st.just("auto"),
                "initial_scale_power": st.integers(0, 32),
                "min_loss_scale": st.floats(1e-3, 10),
            },
        ),
        "zero_optimization": st.fixed_dictionaries(
            {"stage": st.sampled_from([0, 1, 2, 3])},
            optional={
                "reduce_bucket_size": st.integers(0, 10**9).map(float) | st.just("auto"),
                "overlap_comm": st.booleans(),
            },
        ),
        "optimizer": st.fixed_dictionaries(
            {"type": st.sampled_from(["adam", "AdamW", "sgd", "ADAGRAD"])},
            optional={
                "params": st.fixed_dictionaries(
                    {}, optional={"lr": st.floats(0, 1), "weight_decay": st.floats(0, 1)}
                )
            },
        ),
        "mesh": st.fixed_dictionaries(
            {},
            optional={
                "pipeline_parallel_size": st.integers(1, 4),
                "tensor_parallel_size": st.integers(1, 4),
            },
        ),
        "checkpoint": st.fixed_dictionaries(
            {}, optional={"keep_last": st.none() | st.integers(1, 5)}
        ),
    },
)


@settings(max_examples=60, deadline=None)
@given(data=_sections, dp=st.integers(1, 4))
def test_round_trip_of_generated_configs(data: dict, dp: int) -> None:
    mesh = data.get("mesh", {})
    world = dp * mesh.get("pipeline_parallel_size", 1) * mesh.get("tensor_parallel_size", 1)
    config = load_config(data, world_size=world)
    dumped = config.to_dict()
    assert json.loads(json.dumps(dumped)) == dumped
    assert load_config(dumped, world_size=world) == config


# ----------------------------------------------------------------------------- batch sizes

# (written, dp, expected (train_batch_size, micro, gas))
BATCH_TABLE = [
    ({}, 1, (1, 1, 1)),
    ({}, 4, (4, 1, 1)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
    ({"gradient_accumulation_steps": 3}, 2, (6, 1, 3)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}, 3, (48, 2, 8)),
    (
        {
            "train_batch_size": 48,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 8,
        },
        3,
        (48, 2, 8),
    ),
]


@pytest.mark.parametrize(("written", "dp", "expected"), BATCH_TABLE)
def test_batch_triple_table(written: dict, dp: int, expected: tuple[int, int, int]) -> None:
    config = load_config(written, world_size=dp)
    assert tuple(getattr(config, k) for k in BATCH_KEYS) == expected


@pytest.mark.parametrize(
    ("env", "expected_world"),
    [
        ({"WORLD_SIZE": "4"}, 4),
        ({"SLURM_NTASKS": "8"}, 8),
        ({"WORLD_SIZE": "2", "SLURM_NTASKS": "8"}, 2),
        ({}, None),
    ],
)
def test_world_size_from_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict, expected_world: int | None
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert detect_world_size() == expected_world
    config = load_config({"train_micro_batch_size_per_gpu": 2})
    assert config.train_batch_size == 2 * (expected_world or 1)


def test_world_size_from_environment_with_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    config = load_config({"train_batch_size": 16, "mesh": {"tensor_parallel_size": 2}})
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 1)
    config = load_config({"mesh": {"pipeline_parallel_size": 2}}, world_size=2)  # argument wins
    assert config.train_batch_size == 1


def test_bad_world_size_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match="WORLD_SIZE='four' is not an integer"):
        load_config({})


@settings(max_examples=200, deadline=None)
@given(
    mb=st.integers(1, 64),
    gas=st.integers(1, 16),
    dp=st.integers(1, 16),
    written=st.sets(st.sampled_from(BATCH_KEYS)),
)
def test_any_written_subset_resolves_consistently(
    mb: int, gas: int, dp: int, written: set[str]
) -> None:
    full = dict(zip(BATCH_KEYS, (mb * gas * dp, mb, gas), strict=True))
    triple = derive_batch_sizes(dp, **{k: full[k] for k in written})
    assert triple[0] == triple[1] * triple[2] * dp
    for key in written:
        assert triple[BATCH_KEYS.index(key)] == full[key]
    if len(written) >= 2:  # any two determine the third
        assert triple == tuple(full.values())


@settings(max_examples=100, deadline=None)
@given(mb=st.integers(1, 16), gas=st.integers(1, 8), dp=st.integers(1, 8), off=st.integers(1, 5))
def test_inconsistent_triple_prints_all_four_numbers(mb: int, gas: int, dp: int, off: int) -> None:
    tbs = mb * gas * dp + off
    with pytest.raises(ConfigError) as info:
        derive_batch_sizes(dp, tbs, mb, gas)
    assert (
        f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mb} * "
        f"gradient_accumulation_steps {gas} * data-parallel size {dp} = {mb * gas * dp}"
    ) in str(info.value)


def test_resolve_batch_sizes_rederives_only_derived_values() -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 4}, world_size=1)
    assert config.train_batch_size == 4
    assert config.resolve_batch_sizes(4).train_batch_size == 16  # derived -> derived again
    fixed = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert fixed.gradient_accumulation_steps == 4
    assert fixed.resolve_batch_sizes(4).gradient_accumulation_steps == 2
    with pytest.raises(ConfigError, match="not divisible"):
        fixed.resolve_batch_sizes(3)
    with pytest.raises(ConfigError, match="data-parallel size 0"):
        fixed.resolve_batch_sizes(0)


def test_resolve_batch_sizes_refuses_auto() -> None:
    config = load_config({"train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(ConfigError, match='train_micro_batch_size_per_gpu: "auto" must be filled'):
        config.resolve_batch_sizes(2)


# ----------------------------------------------------------------------------- auto


def test_resolve_auto_fills_only_auto_values() -> None:
    config = load_config(CONFIGS / "hf_zero2_auto.json")
    filled = config.resolve_auto(
        {
            "optimizer.params.lr": 1e-3,
            "optimizer.params.betas": [0.9, 0.95],
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 2,
            "train_batch_size": 32,
            "zero_optimization.allgather_bucket_size": 7,  # written by the user: kept
            "zero_optimization.stage3_prefetch_bucket_size": 9,  # not in this config: skipped
        }
    )
    assert filled.optimizer.params.lr == 1e-3 and filled.optimizer.params.betas == (0.9, 0.95)
    assert filled.zero_optimization.allgather_bucket_size == 200_000_000
    assert "stage3_prefetch_bucket_size" not in filled.to_dict()["zero_optimization"]
    assert filled.resolve_batch_sizes(2).train_batch_size == 32
    assert config.optimizer.params.lr == "auto"  # the original is unchanged


def test_resolve_auto_skips_absent_sections_and_rejects_unknown_paths() -> None:
    config = load_config({})
    assert (
        config.resolve_auto({"optimizer.params.lr": 1e-3, "scheduler.params.total_num_steps": 5})
        == config
    )
    with pytest.raises(ConfigError, match="optimzer: unknown key; did you mean optimizer"):
        config.resolve_auto({"optimzer.params.lr": 1e-3})
    with pytest.raises(ConfigError, match="optimizer.params.learning_rate: unknown key"):
        config.resolve_auto({"optimizer.params.learning_rate": 1e-3})


def test_resolve_auto_validates_the_values() -> None:
    config = load_config({"gradient_clipping": "auto"})
    with pytest.raises(ConfigError, match="gradient_clipping: -3"):
        config.resolve_auto({"gradient_clipping": -3})


def test_resolve_auto_defaults_with_hidden_size() -> None:
    config = load_config(CONFIGS / "hf_zero3_auto.json")
    with pytest.raises(
        ConfigError, match='scheduler.params.total_num_steps: "auto" has no default'
    ):
        config.resolve_auto_defaults(hidden_size=64)
    config = config.resolve_auto(
        {"scheduler.params.total_num_steps": 1000, "optimizer.params.lr": 3e-4}
    )
    resolved = config.resolve_auto_defaults(hidden_size=64)
    assert resolved.auto_paths() == []
    z = resolved.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size) == (64 * 64, int(0.9 * 64 * 64))
    assert z.stage3_param_persistence_threshold == 640
    assert resolved.precision == "fp32"
    assert resolved.gradient_clipping == 1.0
    assert resolved.scheduler.params.warmup_max_lr is None  # null: the optimizer's lr
    assert resolved.optimizer.params.betas == (0.9, 0.999)
    final = resolved.resolve_batch_sizes(4)
    assert tuple(getattr(final, k) for k in BATCH_KEYS) == (4, 1, 1)


def test_scheduler_lrs_may_be_per_group_lists() -> None:
    params = {"warmup_min_lr": [0, 1e-5], "warmup_max_lr": [1e-3, 1e-4], "total_num_steps": 10}
    config = load_config({"scheduler": {"type": "WarmupDecayLR", "params": params}})
    assert config.scheduler.params.warmup_max_lr == [1e-3, 1e-4]
    assert load_config(config.to_dict()) == config


def test_resolve_auto_defaults_without_hidden_size() -> None:
    config = load_config(
        {
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
            "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
        }
    )
    resolved = config.resolve_auto_defaults()
    assert resolved.zero_optimization.reduce_bucket_size == 500_000_000
    assert resolved.optimizer.params.lr == 5e-5


def test_auto_defaults_cover_every_field_that_accepts_auto() -> None:
    def auto_fields(model: type[BaseModel], prefix: str) -> set[str]:
        found = set()
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            args = typing.get_args(field.annotation)
            if any(a == typing.Literal["auto"] for a in args):
                found.add(path)
            for sub in args or (field.annotation,):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    found |= auto_fields(sub, f"{path}.")
        return found

    paths = auto_fields(Config, "")
    for kind, registry in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        for model in registry.values():
            paths |= auto_fields(model, f"{kind}.params.")
    assert paths == set(AUTO_DEFAULTS)
    values = auto_default_values(load_config({}), hidden_size=8)
    assert set(values) | {"scheduler.params.total_num_steps"} == set(AUTO_DEFAULTS)


# ----------------------------------------------------------------------------- docs


def _all_models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []

    def visit(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.append(model)
        for field in model.model_fields.values():
            for sub in typing.get_args(field.annotation) or (field.annotation,):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    visit(sub)

    visit(Config)
    for model in [*OPTIMIZER_PARAMS.values(), *SCHEDULER_PARAMS.values()]:
        visit(model)
    return seen


def test_every_field_has_a_docstring() -> None:
    models = _all_models()
    assert len(models) >= 20
    for model in models:
        assert model.__doc__, model
        for name, field in model.model_fields.items():
            assert field.description and len(field.description) > 10, f"{model.__name__}.{name}"


def test_docs_config_md_is_in_sync() -> None:
    expected = config_reference_markdown()
    actual = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert actual == expected, "regenerate: python -m meshtrain.config --markdown > docs/config.md"
    for model in _all_models():
        for name in model.model_fields:
            assert f"`{name}`" in expected


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert config_cli(["--markdown"]) == 0
    assert capsys.readouterr().out == config_reference_markdown()
    assert config_cli([str(CONFIGS / "kitchen_sink_zero1.json"), "--world-size", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["train_micro_batch_size_per_gpu"] == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 5}}')
    assert config_cli([str(bad)]) == 2
    assert "zero_optimization.stage: 5" in capsys.readouterr().err


def test_to_dict_without_derived_values_reloads_under_another_world_size() -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert config.to_dict(derived=False) == {"train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ConfigError, match="!="):
        load_config(config.to_dict(), world_size=4)  # all three written: checked
    assert load_config(config.to_dict(derived=False), world_size=4).train_batch_size == 16
