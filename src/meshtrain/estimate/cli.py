"""``meshtrain estimate``: the model-state memory table of :mod:`meshtrain.estimate.model_states` from
the command line, for a parameter count (``7.5e9``, ``7.5B``) or a model (a reference
decoder spec or a transformers config), without building the model's weights."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from decimal import ROUND_HALF_UP, Decimal

import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.estimate.model_states import OPTIMIZERS, estimate_table

__all__ = ["add_parser", "model_from_spec", "parse_count"]


# --- command line ------------------------------------------------------------------------

_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """ "7.5e9", "7_500_000_000", "7.5B", "350M", "1.3b" -> a parameter count."""
    s = text.strip().replace("_", "").replace(",", "")
    scale = _SUFFIX.get(s[-1:].lower(), 1) if s else 1
    if scale != 1:
        s = s[:-1]
    try:
        value = Decimal(s) * scale
    except ArithmeticError:
        raise ConfigError(
            f"--params: {text!r} is not a count; use e.g. 7.5e9, 7500000000 or 7.5B"
        ) from None
    if not value.is_finite() or value < 1:
        raise ConfigError(f"--params: must be a count >= 1, got {text!r}")
    return int(value.to_integral_value(rounding=ROUND_HALF_UP))


def _decoder_from_spec(spec: str) -> nn.Module:
    from meshtrain.models import Decoder, DecoderConfig

    fields = {f.name: f for f in dataclasses.fields(DecoderConfig)}
    kwargs: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ConfigError(
                f"--model decoder: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}"
            )
        kind = type(fields[key].default)
        raw = raw.strip()
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                kwargs[key] = raw.lower() in ("true", "1")
            else:
                kwargs[key] = kind(raw)
        except ValueError:
            raise ConfigError(
                f"--model decoder: {key}={raw!r} is not a valid {kind.__name__}"
            ) from None
    try:
        cfg = DecoderConfig(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"--model decoder: {exc}") from None
    with torch.device("meta"):  # shapes only: no memory, no init cost
        return Decoder(cfg)


def _hf_from_config(path: str) -> nn.Module:
    if not os.path.exists(path):
        raise ConfigError(
            f"--model hf:{path}: no such file or folder; give a config.json or a folder holding one"
        )
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--model hf:...: needs transformers (pip install 'meshtrain[hf]')"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model hf:{path}: cannot read the config: {exc}") from None
    # The class the checkpoint was saved from (e.g. LlamaForCausalLM, with its LM head);
    # AutoModel would build the bare backbone and miss an untied head.
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    with torch.device("meta"):
        if cls is not None and hasattr(cls, "_from_config"):
            return cls._from_config(config)
        try:  # no architectures recorded: a causal LM (with its head) where the type has one
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            return transformers.AutoModel.from_config(config)


def model_from_spec(spec: str) -> nn.Module:
    """Build ``decoder:KEY=VALUE,...`` or ``hf:PATH`` on the meta device (no memory)."""
    kind, _, rest = spec.partition(":")
    if kind == "decoder":
        return _decoder_from_spec(rest)
    if kind == "hf" and rest:
        return _hf_from_config(rest)
    raise ConfigError(
        f"--model: {spec!r} is not understood; use decoder:KEY=VALUE,... (meshtrain's "
        "reference decoder) or hf:PATH (a transformers config.json or its folder)"
    )


def _run(args: argparse.Namespace) -> int:
    try:
        if args.model is not None:
            source: int | nn.Module = model_from_spec(args.model)
        else:
            source = parse_count(args.params)
        print(
            estimate_table(
                source,
                dp=args.dp,
                precision=args.precision,
                optimizer=int(args.optimizer) if args.optimizer.isdigit() else args.optimizer,
                offload_optimizer=args.offload_optimizer,
                offload_param=args.offload_param,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                expert_params=parse_count(args.expert_params) if args.expert_params else 0,
            )
        )
        if args.pp > 1:
            print()
            print(_pipeline(args, source))
        if args.cp > 1 or (args.seq_len and args.pp == 1):
            print()
            print(_activations(args, source))
    except ConfigError as exc:
        print(f"meshtrain estimate: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _pipeline(args: argparse.Namespace, source: int | nn.Module) -> str:
    """The per-pipeline-rank table (``meshtrain.estimate.pipeline``); needs --model."""
    if not isinstance(source, nn.Module):
        return (
            "Per pipeline rank: give --model instead of --params to see each stage's "
            "parameters and activations (the table above divides the parameters by pp)"
        )
    from meshtrain.estimate.pipeline import pipeline_memory, pipeline_table

    m = args.micro_batches or args.pp
    rows = pipeline_memory(
        source,
        pp=args.pp,
        m=m,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        dp=args.dp,
        stage=args.stage,
        precision=args.precision,
        optimizer=int(args.optimizer) if args.optimizer.isdigit() else args.optimizer,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        checkpointing=args.activation_checkpointing,
    )
    seq = (
        args.seq_len
        or getattr(source.config, "max_seq_len", None)
        or getattr(source.config, "max_position_embeddings", None)
    )
    return pipeline_table(rows, schedule=args.schedule, m=m, seq_len=seq, b=args.micro_batch_size)


def _activations(args: argparse.Namespace, source: int | nn.Module) -> str:
    """Activation memory per rank at the sequence length for cp 1, 2, 4, ... up to --cp
    (``meshtrain.estimate.activations``); needs --model."""
    from meshtrain.estimate.activations import DecoderDims, activation_table

    dims = DecoderDims.of(source) if isinstance(source, nn.Module) else None
    if dims is None:
        return (
            "Activations per rank: give --model (a reference decoder or a Llama-style "
            "transformers config) to see them at each context-parallel size"
        )
    if args.cp < 1:
        raise ConfigError(f"--cp: must be a positive integer, got {args.cp}")
    seq = args.seq_len or getattr(source.config, "max_seq_len", None)
    seq = seq or getattr(source.config, "max_position_embeddings", None)
    cps = sorted({c for c in (1, 2, 4, 8, 16, 32, 64) if c <= args.cp} | {args.cp})
    width = 4 if str(args.precision).lower() == "fp32" else 2
    return activation_table(
        dims, [seq], cps, batch=args.micro_batch_size, width=width, method=args.cp_method
    )


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``meshtrain estimate`` on the top-level ``meshtrain`` command."""
    p = subparsers.add_parser(
        "estimate",
        help="model-state memory per device for every ZeRO stage",
        description="Print parameters, gradients and optimizer states per device for ZeRO "
        "stages 0-3 (ZeRO paper, section 5). GB = 1e9 bytes. Activations and buffers are "
        "not included; see docs/estimate.md.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", metavar="N", help="trainable parameters: 7.5e9, 7.5B, 350M")
    src.add_argument(
        "--model",
        metavar="SPEC",
        help="decoder:dim=4096,n_layers=32,... (reference decoder) or hf:PATH "
        "(a transformers config.json or its folder); built on the meta device",
    )
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree N_d (default 1)")
    p.add_argument("--precision", default="fp16", help="fp16 (default), bf16 or fp32")
    p.add_argument(
        "--optimizer",
        default="Adam",
        help=f"{', '.join(OPTIMIZERS)} (default Adam) or K, optimizer bytes per parameter",
    )
    p.add_argument(
        "--offload-optimizer", action="store_true", help="optimizer states on CPU (stages 1-3)"
    )
    p.add_argument(
        "--offload-param", action="store_true", help="parameter partition on CPU (stage 3)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: with --model, activation memory per rank at "
        "--seq-len for cp 1, 2, 4, ... up to this (default 1)",
    )
    p.add_argument(
        "--cp-method",
        default="all_to_all",
        choices=("all_to_all", "ring"),
        help="context-parallel attention for the activation table (default all_to_all)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree E, carved out of --dp (default 1): experts 1/E per "
        "rank, ZeRO-partitioned over dp/E",
    )
    p.add_argument(
        "--expert-params",
        metavar="N",
        default=None,
        help="with --params: how many of them are routed experts (with --model they are "
        "counted from it: parameters under a module named 'experts')",
    )
    pipe = p.add_argument_group("pipeline (--pp > 1 with --model: a table per pp rank)")
    pipe.add_argument(
        "--schedule",
        default="1f1b",
        choices=("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"),
        help="pipeline schedule (default 1f1b)",
    )
    pipe.add_argument(
        "--micro-batches", type=int, default=0, help="m = gradient_accumulation_steps (default pp)"
    )
    pipe.add_argument("--virtual-stages", type=int, default=1, help="v (interleaved_1f1b)")
    pipe.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    pipe.add_argument("--seq-len", type=int, default=None, help="default: the model's longest")
    pipe.add_argument("--stage", type=int, default=0, help="ZeRO stage for the table (default 0)")
    pipe.add_argument(
        "--activation-checkpointing", action="store_true", help="blocks keep only their input"
    )
    p.set_defaults(func=_run)
    return p
