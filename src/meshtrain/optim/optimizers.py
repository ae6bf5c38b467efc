"""Optimizers and learning-rate schedules from the DeepSpeed config's ``optimizer`` and
``scheduler`` sections.

Optimizers are torch's own (``torch.optim.Adam``/``AdamW``/``SGD``/``Adagrad``): ``fused`` on
CUDA where torch has a fused kernel for that optimizer (Adam, AdamW, SGD), the multi-tensor
``foreach`` implementation on other accelerators, and on CPU the single-tensor one (torch's
own CPU default; torch's CPU ``foreach`` is a loop over the tensors anyway). On CPU
``foreach`` allocates each temporary for *all* tensors at once (``sqrt(v)`` of every master
slice: the size of the whole shard), the single-tensor loop one slice's worth at a time,
which keeps the step's peak memory at ``2 x`` one slice (``parallel/zero/flat_group.py``); the
results are bit-identical. DeepSpeed's names and semantics are kept:

* type ``Adam`` means *decoupled* weight decay (AdamW), as DeepSpeed's FusedAdam does by
  default; ``"adam_w_mode": false`` turns it into torch Adam with L2 weight decay added to
  the gradient. Type ``AdamW`` is always AdamW (DeepSpeed ignores ``adam_w_mode`` there too).
* defaults are DeepSpeed's, i.e. FusedAdam's for Adam/AdamW (lr 1e-3, betas (0.9, 0.999),
  eps 1e-8, weight_decay 0 -- note: torch's AdamW defaults to 0.01) and torch's for SGD and
  Adagrad, which DeepSpeed hands to torch unchanged.
* ``torch_adam`` (choose torch's Adam over FusedAdam) is accepted and ignored: meshtrain
  always uses torch's. ``bias_correction`` is accepted only as ``true``.
* ``fused`` (meshtrain's key, Adam/AdamW only): ``true`` selects torch's fused kernel on
  any device, ``false`` the unfused one; unset means fused on CUDA, unfused elsewhere.
  On CPU the fused AdamW steps a 34.6M-element shard in about 30 ms against foreach's
  110 ms (issue 12's profile), but rounds differently: about 1 ulp (2.4e-7 absolute)
  per step on that shard. The default stays unfused on CPU so that results are
  bit-identical to torch's default AdamW, DDP, FSDP2 and DeepSpeed with a torch AdamW.

Beyond DeepSpeed's four (issue 30; costs and layouts in :mod:`meshtrain.optim.catalog`):

* ``Adafactor``: ``torch.optim.Adafactor`` (torch's own; transformers' ``Adafactor`` class
  is a different algorithm variant). Factored second moment; needs whole parameters.
* ``AdamW8bit``: ``bitsandbytes.optim.AdamW8bit`` (blockwise 8-bit m and v). A parameter
  below ``min_8bit_size`` elements keeps 32-bit state, decided by the *whole* parameter's
  size even when ZeRO gives this rank a slice of it, so a sharded run steps bit-identically.
* ``Lion`` / ``Lion8bit``: ``bitsandbytes.optim.Lion32bit`` / ``Lion8bit``.

bitsandbytes is an optional extra (``meshtrain[quant]``), imported when one of these is
built. ``foreach`` (Adam/AdamW): ``true`` forces torch's multi-tensor implementation.

The learning-rate schedules are in :mod:`meshtrain.optim.lr_schedules`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshtrain.errors import ConfigError

__all__ = ["SUPPORTED_OPTIMIZERS", "build_optimizer"]


SUPPORTED_OPTIMIZERS: tuple[str, ...] = (
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "Adafactor",
    "AdamW8bit",
    "Lion",
    "Lion8bit",
)

_ADAM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
}
# config name -> torch defaults (None: DeepSpeed-only switch, not passed to torch)
_OPTIMIZER_PARAMS: dict[str, dict[str, Any]] = {
    "adam": {
        **_ADAM_DEFAULTS,
        "amsgrad": False,
        "adam_w_mode": None,
        "torch_adam": None,
        "bias_correction": None,
        "fused": None,
        "foreach": None,
    },
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    "adagrad": {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
    },
}
_OPTIMIZER_PARAMS["adamw"] = _OPTIMIZER_PARAMS["adam"]
_OPTIMIZER_PARAMS["adafactor"] = {
    "lr": 1e-2,
    "beta2_decay": -0.8,
    "eps": (None, 1e-3),
    "d": 1.0,
    "weight_decay": 0.0,
    "maximize": False,
}
_OPTIMIZER_PARAMS["adamw8bit"] = {**_ADAM_DEFAULTS, "weight_decay": 1e-2, "min_8bit_size": 4096}
_OPTIMIZER_PARAMS["lion"] = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}
_OPTIMIZER_PARAMS["lion8bit"] = {**_OPTIMIZER_PARAMS["lion"], "min_8bit_size": 4096}
_BNB_CLASSES = {"adamw8bit": "AdamW8bit", "lion": "Lion32bit", "lion8bit": "Lion8bit"}
# torch has fused kernels for these on CUDA; Adagrad's fused kernel is CPU-only.
_FUSED_ON_CUDA = frozenset({"adam", "adamw", "sgd"})


def canonical_name(name: str, supported: Sequence[str], path: str) -> str:
    for candidate in supported:
        if isinstance(name, str) and name.lower() == candidate.lower():
            return candidate
    raise ConfigError(f"{path}: unknown type {name!r}; supported: {', '.join(supported)}")


def check_names(given: dict[str, Any], allowed: Sequence[str], path: str, type_name: str) -> None:
    for name in given:
        if name not in allowed:
            hint = ""
            if name == "max_grad_norm":
                hint = " (clip gradients with the top-level 'gradient_clipping' key instead)"
            raise ConfigError(
                f"{path}.{name}: unknown parameter for {type_name}{hint}; allowed: {', '.join(allowed)}"
            )


def _betas(value: Any, path: str) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(f"{path}: expected two numbers [beta1, beta2], got {value!r}")
    return (value[0], value[1])


def runs_fused(opt_type: str, params: dict[str, Any], device_type: str) -> bool:
    """Whether ``build_optimizer`` gives torch's fused kernel for this type, ``params``
    (``optimizer.params``) and device type (module docstring)."""
    key = opt_type.lower()
    fused = params.get("fused") if key in ("adam", "adamw") else None
    if fused is None:  # foreach asked for: the fused kernel is not the default then
        fused = device_type == "cuda" and key in _FUSED_ON_CUDA and not params.get("foreach")
    return bool(fused)


def build_optimizer(
    opt_type: str,
    params: dict[str, Any],
    param_groups: list[dict[str, Any]],
    *,
    device_type: str = "cpu",
) -> torch.optim.Optimizer:
    """Build the torch optimizer a DeepSpeed ``optimizer`` config section describes.

    Args:
        opt_type: DeepSpeed type name, case-insensitive: one of :data:`SUPPORTED_OPTIMIZERS`.
        params: the section's ``params`` (DeepSpeed names, ``"auto"`` already resolved).
        param_groups: torch-style groups ``[{"params": [...], "weight_decay": 0.0, ...}]``;
            a key set in a group wins over ``params`` for that group. Not modified.
        device_type: where the parameters live; ``"cuda"`` selects torch's fused kernel for
            Adam, AdamW and SGD; other accelerators use ``foreach``, CPU the single-tensor
            implementation (module docstring).

    Raises:
        ConfigError: unknown type or parameter name, or a value torch rejects; the message
            names the config path (``optimizer.params.<name>``) and the allowed names.
    """
    name = canonical_name(opt_type, SUPPORTED_OPTIMIZERS, "optimizer.type")
    key = name.lower()
    allowed = _OPTIMIZER_PARAMS[key]
    check_names(params, list(allowed), "optimizer.params", name)

    kwargs = {k: v for k, v in allowed.items() if v is not None}
    kwargs.update({k: v for k, v in params.items() if allowed[k] is not None})
    if "betas" in kwargs:
        kwargs["betas"] = _betas(kwargs["betas"], "optimizer.params.betas")

    cls: type[torch.optim.Optimizer]
    if key in _BNB_CLASSES:
        cls = _bitsandbytes_class(_BNB_CLASSES[key])
        return _construct(cls, name, params, allowed, kwargs, param_groups)
    if key == "adafactor":
        kwargs["eps"] = tuple(kwargs["eps"])
        kwargs["foreach"] = device_type != "cpu"
        return _construct(torch.optim.Adafactor, name, params, allowed, kwargs, param_groups)
    if key in ("adam", "adamw"):
        if params.get("bias_correction", True) is not True:
            raise ConfigError(
                "optimizer.params.bias_correction: only true is supported (torch's Adam always "
                f"corrects the moment bias), got {params['bias_correction']!r}; remove the key"
            )
        decoupled = key == "adamw" or params.get("adam_w_mode", True)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    else:
        cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[key]

    foreach = params.get("foreach") if key in ("adam", "adamw") else None
    kwargs.pop("foreach", None)
    if params.get("fused") and foreach:
        raise ConfigError(
            "optimizer.params: fused and foreach are both true; torch runs one "
            "implementation, set one of them"
        )
    fused = runs_fused(key, params, device_type)
    if fused:
        kwargs["fused"] = True
    else:  # CPU: torch's own default there (module docstring: temporaries)
        kwargs["foreach"] = bool(foreach) if foreach is not None else device_type != "cpu"
    return _construct(cls, name, params, allowed, kwargs, param_groups)


def _bitsandbytes_class(class_name: str) -> type[torch.optim.Optimizer]:
    """bitsandbytes' optimizer, taught to choose 8-bit state by the whole parameter's size
    (a ZeRO slice of a large parameter is small; module docstring)."""
    try:
        import bitsandbytes.optim as bnb_optim
    except ImportError as err:
        raise ConfigError(
            f"optimizer.type: {class_name} needs bitsandbytes, which is not installed; "
            "pip install 'meshtrain[quant]' (or bitsandbytes>=0.45)"
        ) from err
    base = getattr(bnb_optim, class_name)

    class WholeParameterSized(base):  # type: ignore[misc,valid-type]
        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            p = self.param_groups[gindex]["params"][pindex]
            whole = getattr(p, "meshtrain_whole_numel", None)
            if whole is not None:  # bitsandbytes compares p.numel() with min_8bit_size
                config["min_8bit_size"] = 0 if whole >= self.args.min_8bit_size else 1 << 62
            bits = getattr(p, "meshtrain_optim_bits", None)
            if bits is not None:  # a parameter's own width (``keep_embeddings_32bit``)
                config["optim_bits"] = bits
            return config

    WholeParameterSized.__name__ = WholeParameterSized.__qualname__ = class_name
    return WholeParameterSized


def keep_embeddings_32bit(model: torch.nn.Module) -> int:
    """Give every trainable ``nn.Embedding`` weight of ``model`` 32-bit state in an 8-bit
    bitsandbytes optimizer, as transformers' Trainer does for ``optim="adamw_bnb_8bit"``
    and the other 8-bit names (it registers ``{"optim_bits": 32}`` overrides with
    bitsandbytes' ``GlobalOptimManager``: 8-bit state of a large, sparsely updated
    embedding is less stable, and re-quantizing it every step costs time). The mark
    (``meshtrain_optim_bits``) follows the weight into its ZeRO master slices. Returns the
    elements marked."""
    marked = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Embedding) and w is not None and w.requires_grad:
            if getattr(w, "meshtrain_optim_bits", None) is None:
                w.meshtrain_optim_bits = 32
                marked += w.numel()
    return marked


def _construct(cls, name, params, allowed, kwargs, param_groups) -> torch.optim.Optimizer:
    # Torch checks the hyper-parameters (lr >= 0, 0 <= beta < 1, ...) in its constructor;
    # running it on a dummy tensor first tells a bad config value apart from a bad group.
    try:
        cls([torch.zeros(1)], **kwargs)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"optimizer.params: {cls.__name__} rejects {params!r}: {err}; "
            f"allowed parameters for {name}: {', '.join(allowed)}"
        ) from err

    groups = []
    for group in param_groups:
        group = dict(group)
        if "betas" in group:
            group["betas"] = _betas(group["betas"], "optimizer param group 'betas'")
        groups.append(group)
    return cls(groups, **kwargs)
