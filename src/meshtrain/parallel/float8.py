"""``fp8.enabled``: the model's linear layers as torchao ``Float8Linear`` (tensorwise scaling).

Each converted layer keeps its weight (and bias) as an ordinary parameter in the model's
dtype; at every forward it casts the input and the weight to ``float8_e4m3fn`` with one
dynamic scale per tensor (amax / the format's max) and multiplies them with
``torch._scaled_mm`` on the tensor cores; backward casts the output gradient to
``float8_e5m2`` the same way. So parameters, gradients, masters and optimizer states, and
with them ZeRO, checkpoints and ``memory_report()``, are exactly as without fp8: only the
matmuls change. This is torchtitan's "tensorwise" recipe.

Where it runs in ``parallelize``: after the pipeline split (a rank converts only its own
layers) and before activation checkpointing and ``torch.compile`` (the checkpointed and
compiled code must be the float8 code; torchao's casts are meant to be fused by
inductor). Refused by name: tensor parallelism (needs torchao's float8 TP plans, not
wired), a missing torchao, and a device without float8 tensor cores (compute capability
below 8.9, or a CPU) unless ``fp8.emulate`` is set.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshtrain.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with float8 tensor cores


def _load_torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError(
            f"fp8.enabled: true needs the torchao package, which cannot be imported ({exc}); "
            "install it (pip install torchao) or set fp8.enabled to false"
        ) from None
    return Float8LinearConfig, convert_to_float8_training


def check_device(device: torch.device, emulate: bool) -> None:
    """Refuse a device without float8 tensor cores, unless emulating."""
    if emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"fp8.enabled: true needs a CUDA GPU with float8 tensor cores (compute capability "
            f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}); this rank's device is {device}. "
            "Set fp8.enabled to false, or fp8.emulate to true for a (slow) test run"
        )
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"fp8.enabled: true needs compute capability >= {MIN_CAPABILITY[0]}."
            f"{MIN_CAPABILITY[1]} (H100, H200, L4, L40S); {name} has {cap[0]}.{cap[1]}. "
            "Set fp8.enabled to false, or fp8.emulate to true for a (slow) test run"
        )


def _convertible(module: nn.Module, fqn: str, skip: list[str]) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if any(s in fqn for s in skip):
        return False
    # torch._scaled_mm needs both matmul dimensions divisible by 16
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, fp8, device: torch.device, tp_size: int = 1) -> list[str]:
    """Convert ``model``'s eligible linear layers in place; return their qualified names.

    ``fp8`` is the config's ``FP8Config``. Raises ConfigError (see module docstring).
    """
    if tp_size > 1:
        raise ConfigError(
            f"fp8.enabled: true with tensor parallelism (tp={tp_size}) is not implemented; "
            "set fp8.enabled to false or mesh.tensor_parallel_size to 1"
        )
    config_cls, convert = _load_torchao()
    check_device(device, fp8.emulate)
    config = config_cls.from_recipe_name("tensorwise")
    if fp8.emulate:
        config = dataclasses.replace(config, emulate=True)
    skip = list(fp8.skip_modules)
    names = [n for n, m in model.named_modules() if _convertible(m, n, skip)]
    if not names:
        raise ConfigError(
            f"fp8.enabled: true but no linear layer of {type(model).__name__} can be "
            f"converted (fp8.skip_modules {skip}, features must be multiples of 16); "
            "set fp8.enabled to false"
        )
    wanted = set(names)
    convert(model, config=config, module_filter_fn=lambda m, fqn: fqn in wanted)
    return names
