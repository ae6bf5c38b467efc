"""Model-state memory per device for each ZeRO stage (ZeRO paper, section 5 / Figure 1).

With ``Psi`` trainable parameters (after tensor/pipeline parallelism, ``Psi / (tp * pp)``
per rank), data-parallel degree ``N_d`` and ``K`` bytes of optimizer state per parameter,
mixed-precision training holds 2 Psi bytes of 16-bit parameters, 2 Psi of 16-bit
gradients and K Psi of optimizer states (Adam: fp32 master weights + momentum + variance,
K = 12). Each ZeRO stage partitions one more of the three over the N_d ranks::

    stage 0  (DDP)        (2 + 2 + K) Psi
    stage 1  (P_os)        2 Psi + 2 Psi + K Psi / N_d
    stage 2  (P_os+g)      2 Psi + (2 + K) Psi / N_d
    stage 3  (P_os+g+p)   (2 + 2 + K) Psi / N_d

7.5e9 parameters with Adam at N_d = 64: 120 / 31.4 / 16.6 / 1.88 GB (GB = 1e9 bytes),
the paper's table. fp32 training keeps 4-byte parameters and gradients and no separate
master copy (Adam: K = 8; with optimizer offload the host steps its own fp32 copy, so
K = 12 again). ``offload_optimizer`` moves the optimizer-state term to host
memory, ``offload_param`` (stage 3) the parameter partition too; both are reported in
``ModelStates.host``, per rank.

A partition is rounded up to whole elements (``ceil(Psi / N_d)``, what the largest rank
holds; ZeRO pads its flat buffers to a multiple of N_d), so the numbers are exact bytes.
Frozen parameters (``requires_grad=False``, e.g. a LoRA base model) count as parameters
only: no gradients, no optimizer state. Not included: activations, temporary buffers
(gradient buckets, gathered ZeRO-3 layers, communication buffers), the CUDA context and
allocator fragmentation. See docs/estimate.md.

Import cost: torch only; ``transformers`` is imported when an ``hf:`` model is asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

import torch
from torch import nn

from meshtrain.errors import ConfigError

__all__ = [
    "ModelStates",
    "add_parser",
    "count_params",
    "estimate_table",
    "model_states_bytes",
    "optimizer_state_bytes",
]

PRECISIONS: tuple[str, ...] = ("fp16", "bf16", "fp32")
STAGES: tuple[int, ...] = (0, 1, 2, 3)
# Optimizer-state bytes per trainable parameter, K: (mixed precision, fp32). Mixed
# precision adds a 4-byte fp32 master copy of the weights; in fp32 the weights are the
# master. Adam: m and v; SGD with momentum: one buffer; plain SGD: none; Adagrad: sum.
_OPTIMIZER_K: dict[str, tuple[str, int, int]] = {
    "adam": ("Adam", 12, 8),
    "adamw": ("AdamW", 12, 8),
    "sgd": ("SGD", 4, 0),
    "sgdmomentum": ("SGD-momentum", 8, 4),
    "adagrad": ("Adagrad", 8, 4),
}
OPTIMIZERS: tuple[str, ...] = tuple(name for name, _, _ in _OPTIMIZER_K.values())
_PARTITIONS = ("-", "os", "os+g", "os+g+p")  # the paper's names for stages 0..3


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model state held by one rank.

    ``params``, ``grads`` and ``optimizer`` are on the device (after offload); ``host`` is
    what offload moved to CPU memory for this rank (a node needs it once per rank).
    """

    params: int
    grads: int
    optimizer: int
    host: int = 0

    @property
    def total(self) -> int:
        """Device bytes: params + grads + optimizer."""
        return self.params + self.grads + self.optimizer


def _param_split(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) element counts; a tied (shared) parameter is counted once."""
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    frozen = sum(p.numel() for p in seen.values() if not p.requires_grad)
    return trainable, frozen


def count_params(model: nn.Module) -> int:
    """Trainable parameters of ``model``, tied (shared) parameters counted once."""
    return _param_split(model)[0]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
    return value


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number or a torch.nn.Module, got {value!r}")
    if not math.isfinite(value) or round(value) < minimum:
        raise ConfigError(f"{name}: must be a finite count >= {minimum}, got {value!r}")
    return int(round(value))


def _precision(precision: str) -> str:
    key = str(precision).lower()
    if key not in PRECISIONS:
        raise ConfigError(
            f"precision: unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}"
        )
    return key


def optimizer_state_bytes(optimizer: str | int = "Adam", precision: str = "fp16") -> int:
    """K, the optimizer-state bytes per trainable parameter (fp32 master copy included).

    ``optimizer`` is a name (case-insensitive: Adam, AdamW, SGD, SGD-momentum, Adagrad) or
    K itself as an integer, for an optimizer not listed (e.g. 6 for 8-bit Adam + master).
    """
    if isinstance(optimizer, int) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ConfigError(f"optimizer: K must be >= 0 bytes per parameter, got {optimizer}")
        return optimizer
    mixed = _precision(precision) != "fp32"
    key = str(optimizer).lower().replace("-", "").replace("_", "")
    if key == "momentum":
        key = "sgdmomentum"
    if key not in _OPTIMIZER_K:
        raise ConfigError(
            f"optimizer: unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)} "
            "(case-insensitive) or an integer K (optimizer-state bytes per parameter)"
        )
    _, k_mixed, k_fp32 = _OPTIMIZER_K[key]
    return k_mixed if mixed else k_fp32


def model_states_bytes(
    num_params: int | float | nn.Module,
    *,
    dp: int = 1,
    stage: int = 0,
    precision: str = "fp16",
    optimizer: str | int = "Adam",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    tp: int = 1,
    pp: int = 1,
    frozen_params: int | float = 0,
) -> ModelStates:
    """Model-state bytes per rank for ZeRO ``stage`` at data-parallel degree ``dp``.

    ``num_params``: the trainable parameter count (7.5e9 is fine) or a model, whose
    trainable parameters are counted with :func:`count_params` and whose frozen ones are
    added to ``frozen_params``. ``precision``: "fp16"/"bf16" (mixed precision: 16-bit
    params and grads, fp32 master in the optimizer state) or "fp32". ``optimizer``: see
    :func:`optimizer_state_bytes`. ``offload_optimizer`` (stage >= 1) puts the optimizer
    states in host memory, ``offload_param`` (stage 3) the parameter partition. ``tp`` and
    ``pp`` divide the parameters first. Raises ``ConfigError`` on a bad argument.
    """
    if isinstance(num_params, nn.Module):
        trainable, frozen = _param_split(num_params)
    else:
        trainable, frozen = _count("num_params", num_params, 1), 0
    frozen += _count("frozen_params", frozen_params, 0)
    dp, tp, pp = _positive_int("dp", dp), _positive_int("tp", tp), _positive_int("pp", pp)
    if stage not in STAGES or isinstance(stage, bool):
        raise ConfigError(f"stage: must be one of 0, 1, 2, 3, got {stage!r}")
    if offload_optimizer and stage < 1:
        raise ConfigError(
            "offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0); "
            "set stage >= 1 or offload_optimizer=False"
        )
    if offload_param and stage != 3:
        raise ConfigError(
            f"offload_param: parameter offload needs ZeRO stage 3 (stage is {stage}); "
            "set stage=3 or offload_param=False"
        )
    k = optimizer_state_bytes(optimizer, precision)
    width = 4 if _precision(precision) == "fp32" else 2  # bytes of a param and of a grad
    if offload_optimizer and width == 4 and not isinstance(optimizer, int):
        k += 4  # an fp32 model offloaded: the host steps its own fp32 copy of the weights

    def shard(n: int, parts: int) -> int:
        return -(-n // parts)  # ceil: the largest rank's share

    trainable, frozen = shard(trainable, tp * pp), shard(frozen, tp * pp)
    every = trainable + frozen
    params = width * (shard(every, dp) if stage >= 3 else every)
    grads = width * (shard(trainable, dp) if stage >= 2 else trainable)
    opt = k * (shard(trainable, dp) if stage >= 1 else trainable)
    host = 0
    if offload_optimizer:
        host, opt = host + opt, 0
    if offload_param:
        host, params = host + params, 0
    return ModelStates(params=params, grads=grads, optimizer=opt, host=host)


def _gb(nbytes: int) -> str:
    """Decimal GB to three significant digits, rounding half up as the paper does."""
    if nbytes == 0:
        return "0 GB"
    value = Decimal(nbytes) / Decimal(10**9)
    places = max(0, 2 - value.adjusted())
    return f"{value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)} GB"


def _human_count(n: int) -> str:
    for factor, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= factor:
            return f"{n / factor:.3g}{suffix}"
    return str(n)


def estimate_table(
    num_params: int | float | nn.Module,
    *,
    dp: int = 1,
    precision: str = "fp16",
    optimizer: str | int = "Adam",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    tp: int = 1,
    pp: int = 1,
    frozen_params: int | float = 0,
) -> str:
    """The ``meshtrain estimate`` table: one row per ZeRO stage 0..3, in GB (1e9 bytes).

    A requested offload is applied to the stages that support it (optimizer offload:
    1-3, parameter offload: 3) and the ``offload`` column says which were applied.
    """
    if isinstance(num_params, nn.Module):
        trainable, frozen = _param_split(num_params)
        frozen_params = _count("frozen_params", frozen_params, 0) + frozen
        num_params = trainable
    common = dict(dp=dp, precision=precision, optimizer=optimizer, tp=tp, pp=pp)
    rows = []
    for stage in STAGES:
        off_opt, off_par = offload_optimizer and stage >= 1, offload_param and stage == 3
        s = model_states_bytes(
            num_params,
            stage=stage,
            offload_optimizer=off_opt,
            offload_param=off_par,
            frozen_params=frozen_params,
            **common,
        )
        offload = "+".join(n for n, on in (("optimizer", off_opt), ("params", off_par)) if on)
        row = [str(stage), _PARTITIONS[stage], _gb(s.params), _gb(s.grads), _gb(s.optimizer)]
        row.append(_gb(s.total))
        if offload_optimizer or offload_param:
            row += [offload or "-", _gb(s.host)]
        rows.append(row)
    head = ["stage", "partitioned", "params", "grads", "optimizer", "total"]
    if offload_optimizer or offload_param:
        head += ["offload", "host"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    left = {0, 1, 6}  # text columns; numbers are right-aligned

    def fmt(r: list[str]) -> str:
        cells = (
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        return "  ".join(cells).rstrip()

    k = optimizer_state_bytes(optimizer, precision)
    prec = _precision(precision)
    width = 4 if prec == "fp32" else 2
    n = _count("num_params", num_params, 1)
    frozen_n = _count("frozen_params", frozen_params, 0)
    mode = "fp32" if prec == "fp32" else f"{prec} mixed precision"
    name = f"K={k}" if isinstance(optimizer, int) else f"{_optimizer_name(optimizer)}, K={k}"
    lines = [
        f"Model states per device: {_human_count(n)} trainable parameters ({n:,})"
        + (f" + {_human_count(frozen_n)} frozen" if frozen_n else "")
        + f", dp={dp}, tp={tp}, pp={pp}",
        f"{mode}, {name}: {width} + {width} + {k} bytes per parameter "
        "(params + grads + optimizer states)",
        "GB = 1e9 bytes, per rank; total = device memory; activations, buffers and "
        "fragmentation not included",
        "",
        fmt(head),
        *(fmt(r) for r in rows),
    ]
    return "\n".join(lines)


def _optimizer_name(optimizer: str) -> str:
    key = str(optimizer).lower().replace("-", "").replace("_", "")
    return _OPTIMIZER_K["sgdmomentum" if key == "momentum" else key][0]


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
            )
        )
    except ConfigError as exc:
        print(f"meshtrain estimate: error: {exc}", file=sys.stderr)
        return 2
    return 0


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
    p.set_defaults(func=_run)
    return p
