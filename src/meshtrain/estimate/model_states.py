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

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

from torch import nn

from meshtrain.errors import ConfigError

__all__ = [
    "ModelStates",
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
# The others (issue 30): meshtrain.optim.catalog's state bytes (8-bit: 1 byte per state
# element plus one fp32 absmax per 256; Adafactor: its row and column factors, ~0 per
# element of a matrix, counted as 0).
_OPTIMIZER_K: dict[str, tuple[str, float, float]] = {
    "adam": ("Adam", 12, 8),
    "adamw": ("AdamW", 12, 8),
    "sgd": ("SGD", 4, 0),
    "sgdmomentum": ("SGD-momentum", 8, 4),
    "adagrad": ("Adagrad", 8, 4),
    "adafactor": ("Adafactor", 4, 0),
    "adamw8bit": ("AdamW8bit", 4 + 2 + 8 / 256, 2 + 8 / 256),
    "lion": ("Lion", 8, 4),
    "lion8bit": ("Lion8bit", 4 + 1 + 4 / 256, 1 + 4 / 256),
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

    def __add__(self, other: ModelStates) -> ModelStates:
        """Two holdings of one rank together (field by field)."""
        return ModelStates(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.host + other.host,
        )


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


def positive_int(name: str, value: object) -> int:
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


def optimizer_state_bytes(optimizer: str | int = "Adam", precision: str = "fp16") -> float:
    """K, the optimizer-state bytes per trainable parameter (fp32 master copy included).

    ``optimizer`` is a name (case-insensitive: Adam, AdamW, SGD, SGD-momentum, Adagrad,
    Adafactor, AdamW8bit, Lion, Lion8bit) or K itself as an integer, for an optimizer not
    listed. The 8-bit ones are not whole numbers (their absmax per 256 elements).
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
    ep: int = 1,
    expert_params: int | float = 0,
) -> ModelStates:
    """Model-state bytes per rank for ZeRO ``stage`` at data-parallel degree ``dp``.

    ``num_params``: the trainable parameter count (7.5e9 is fine) or a model, whose
    trainable parameters are counted with :func:`count_params` and whose frozen ones are
    added to ``frozen_params``. ``precision``: "fp16"/"bf16" (mixed precision: 16-bit
    params and grads, fp32 master in the optimizer state) or "fp32". ``optimizer``: see
    :func:`optimizer_state_bytes`. ``offload_optimizer`` (stage >= 1) puts the optimizer
    states in host memory, ``offload_param`` (stage 3) the parameter partition. ``tp`` and
    ``pp`` divide the parameters first; for a model with a tensor-parallel plan the
    per-rank count is exact instead (sharded weights padded / tp, norms and row biases
    whole: ``meshtrain.parallel.tensor.sizes``). Expert parallelism (``ep`` > 1, carved
    out of ``dp``): ``expert_params`` of the trainable parameters (for a model: the ones
    ``meshtrain.estimate.experts`` finds) are routed experts, ``1 / (ep pp)`` of them per
    rank and ZeRO-partitioned over ``dp / ep``; the rest as without ep. Raises
    ``ConfigError`` on a bad argument.
    """
    dp, tp, pp = positive_int("dp", dp), positive_int("tp", tp), positive_int("pp", pp)
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

    def states(trainable: int, frozen: int, n_d: int) -> ModelStates:
        every = trainable + frozen
        params = width * (_shard(every, n_d) if stage >= 3 else every)
        grads = width * (_shard(trainable, n_d) if stage >= 2 else trainable)
        opt = math.ceil(k * (_shard(trainable, n_d) if stage >= 1 else trainable))
        host = 0
        if offload_optimizer:
            host, opt = host + opt, 0
        if offload_param:
            host, params = host + params, 0
        return ModelStates(params=params, grads=grads, optimizer=opt, host=host)

    if ep != 1 or expert_params:
        from meshtrain.estimate.experts import dense_on_one_tp_rank, expert_counts, split_model

        (dense, dense_frozen), (expert, expert_frozen) = split_model(num_params, expert_params)
        local = dense_on_one_tp_rank(num_params, tp)
        extra = _count("frozen_params", frozen_params, 0)
        frozen_local = _shard(dense_frozen + extra, tp) if local is None else local[1]
        frozen_local += 0 if local is None else _shard(extra, tp)
        counts = expert_counts(
            dense, expert, ep=ep, dp=dp, tp=tp, pp=pp, dense_tp_local=local and local[0]
        )
        a = states(counts.dense_per_rank, _shard(frozen_local, pp), dp)
        b = states(counts.expert_per_rank, _shard(expert_frozen, ep * pp), dp // ep)
        return ModelStates(*(x + y for x, y in zip(_fields(a), _fields(b), strict=True)))

    tp_divides = tp
    if isinstance(num_params, nn.Module):
        trainable, frozen = _param_split(num_params)
        if tp > 1:
            from meshtrain.parallel.tensor.plans import plan_for

            if plan_for(num_params) is not None:  # exact: replicated norms, padding
                from meshtrain.parallel.tensor.sizes import local_parameter_counts

                trainable, frozen = local_parameter_counts(num_params, tp)
                tp_divides = 1
    else:
        trainable, frozen = _count("num_params", num_params, 1), 0
    frozen += _count("frozen_params", frozen_params, 0)
    return states(_shard(trainable, tp_divides * pp), _shard(frozen, tp_divides * pp), dp)


def _shard(n: int, parts: int) -> int:
    return -(-n // parts)  # ceil: the largest rank's share


def _fields(s: ModelStates) -> tuple[int, int, int, int]:
    return (s.params, s.grads, s.optimizer, s.host)


def format_gb(nbytes: int) -> str:
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
    ep: int = 1,
    expert_params: int | float = 0,
) -> str:
    """The ``meshtrain estimate`` table: one row per ZeRO stage 0..3, in GB (1e9 bytes).

    A requested offload is applied to the stages that support it (optimizer offload:
    1-3, parameter offload: 3) and the ``offload`` column says which were applied. With
    ``ep`` > 1 (or ``expert_params``) a line counts expert and non-expert parameters per
    rank and the rows hold both parts (``model_states_bytes``).
    """
    experts_line, extra = None, {}
    if ep != 1 or expert_params:  # the model stays whole: its experts are counted from it
        from meshtrain.estimate.experts import dense_on_one_tp_rank, expert_counts, split_model

        (dense, _), (expert, _) = split_model(num_params, expert_params)
        local = dense_on_one_tp_rank(num_params, tp)
        experts_line = expert_counts(
            dense, expert, ep=ep, dp=dp, tp=tp, pp=pp, dense_tp_local=local and local[0]
        ).line()
        extra = {
            "ep": ep,
            "expert_params": 0 if isinstance(num_params, nn.Module) else expert_params,
        }
    elif isinstance(num_params, nn.Module):
        trainable, frozen = _param_split(num_params)
        frozen_params = _count("frozen_params", frozen_params, 0) + frozen
        num_params = trainable
    common = dict(dp=dp, precision=precision, optimizer=optimizer, tp=tp, pp=pp, **extra)
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
        row = [
            str(stage),
            _PARTITIONS[stage],
            format_gb(s.params),
            format_gb(s.grads),
            format_gb(s.optimizer),
        ]
        row.append(format_gb(s.total))
        if offload_optimizer or offload_param:
            row += [offload or "-", format_gb(s.host)]
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
    if isinstance(num_params, nn.Module):  # with experts: counted from the model
        trainable, frozen = _param_split(num_params)
        num_params, frozen_params = trainable, _count("frozen_params", frozen_params, 0) + frozen
    n = _count("num_params", num_params, 1)
    frozen_n = _count("frozen_params", frozen_params, 0)
    mode = "fp32" if prec == "fp32" else f"{prec} mixed precision"
    name = f"K={k}" if isinstance(optimizer, int) else f"{_optimizer_name(optimizer)}, K={k}"
    lines = [
        f"Model states per device: {_human_count(n)} trainable parameters ({n:,})"
        + (f" + {_human_count(frozen_n)} frozen" if frozen_n else "")
        + f", dp={dp}, tp={tp}, pp={pp}",
        *([experts_line] if experts_line else []),
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
