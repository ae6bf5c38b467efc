"""How the Accelerator turns its arguments into an Engine config, and RNG state for resume.

The config is the user's (dict, JSON/YAML path or ``Config``) with three things merged in:
``fp16`` / ``bf16`` from ``mixed_precision``, ``gradient_accumulation_steps`` from the
argument, and ``train_micro_batch_size_per_gpu`` from the training loader's batch size
(the first shuffled prepared loader; a value the config gives must then agree or be
"auto"). Saying one thing twice differently is a ConfigError naming both.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.errors import ConfigError

_PRECISIONS = (None, "no", "fp16", "bf16")


def config_dict(config, mixed_precision: str | None, gas: int) -> dict[str, Any]:
    """The user's config as a dict, with ``mixed_precision`` and the accumulation steps
    merged in; ConfigError when the config already says something different."""
    from meshtrain.config import Config
    from meshtrain.config.loading import read_config_file

    if config is None:
        d: dict[str, Any] = {}
    elif isinstance(config, Config):
        d = config.to_dict(derived=False)
    elif isinstance(config, dict):
        d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    elif isinstance(config, str | os.PathLike):
        d = read_config_file(config)
    else:
        raise ConfigError(
            f"Accelerator(config=...): {type(config).__name__} is not allowed; pass a dict, "
            "a path to a JSON/YAML config or a meshtrain Config"
        )
    if mixed_precision not in _PRECISIONS:
        raise ConfigError(f"mixed_precision={mixed_precision!r}: use one of {_PRECISIONS}")
    for name in ("fp16", "bf16"):
        enabled = (d.get(name) or {}).get("enabled") is True
        if mixed_precision == name and not enabled:
            d[name] = {**(d.get(name) or {}), "enabled": True}
        elif mixed_precision not in (None, name) and enabled:
            raise ConfigError(
                f"mixed_precision={mixed_precision!r} but the config enables {name}; "
                "give the precision in one place"
            )
    given = d.get("gradient_accumulation_steps")
    if given not in (None, "auto") and gas != 1 and int(given) != gas:
        raise ConfigError(
            f"gradient_accumulation_steps={gas} but the config says {given}; give it once"
        )
    if given in (None, "auto"):
        d["gradient_accumulation_steps"] = gas
    return d


# accelerate's constructor arguments meshtrain does not implement, and why
_REFUSED = {
    "dispatch_batches": "every process reads its own batches from the dataset (the rows "
    "dispatch_batches=True would send it, in the same order)",
    "even_batches": "the loaders always even out the ranks, padding the last global batch "
    "with the first rows as accelerate does (gather_for_metrics drops the repeats)",
    "kwargs_handlers": "DDP/GradScaler/InitProcessGroup kwargs do not apply to the Engine; "
    "use config= (a DeepSpeed config) instead",
    "deepspeed_plugin": "pass the DeepSpeed config itself as config=",
    "fsdp_plugin": "use config= with zero_optimization.stage 3 (parameters sharded)",
    "megatron_lm_plugin": "use config= with mesh.tensor_parallel_size / pipeline_parallel_size",
    "torch_tp_plugin": "use config= with mesh.tensor_parallel_size",
    "parallelism_config": "use config= with the mesh section",
    "rng_types": "save_state/load_state carry torch, python, numpy (and CUDA) RNG states",
    "dynamo_backend": "use config= with compile",
    "dynamo_plugin": "use config= with compile",
    "fp8_recipe_handler": "fp8 is not supported",
    "gradient_accumulation_plugin": "pass gradient_accumulation_steps=",
    "project_config": "pass project_dir=",
    "logging_dir": "pass project_dir= (the trackers write under it)",
}


def dataloader_options(config: Any, split_batches: Any = None) -> bool:
    """accelerate's ``DataLoaderConfiguration`` (read by attribute, so accelerate need not
    be installed): returns ``split_batches``; refuses by name what meshtrain's loaders do
    not do. ``non_blocking`` and ``use_stateful_dataloader`` need nothing: batches are
    moved with ``non_blocking=True`` and every prepared loader is resumable already.
    ``Accelerator(split_batches=...)`` itself does nothing in accelerate 1.15, nor here:
    a warning says so."""
    if split_batches is not None:
        import logging

        logging.getLogger("meshtrain").warning(
            "Accelerator(split_batches=%r) does nothing, as in accelerate 1.15 (which ignores "
            "it): pass dataloader_config=DataLoaderConfiguration(split_batches=...)",
            split_batches,
        )
    if config is None:
        return False
    wanted = {
        "dispatch_batches": (None, False),
        "even_batches": (True,),
        "use_seedable_sampler": (False,),
        "data_seed": (None,),
    }
    for name, allowed in wanted.items():
        value = getattr(config, name, allowed[0])
        if value not in allowed:
            why = {
                "dispatch_batches": _REFUSED["dispatch_batches"],
                "even_batches": _REFUSED["even_batches"],
                "use_seedable_sampler": "the shuffled loaders follow accelerate's default "
                "(a generator seeded from the global RNG at prepare); pass Accelerator(seed=) "
                "to fix the seed",
                "data_seed": "it applies to use_seedable_sampler, which is not supported; "
                "pass Accelerator(seed=) instead",
            }[name]
            raise ConfigError(
                f"Accelerator(dataloader_config=...{name}={value!r}) is not supported: {why}"
            )
    return bool(getattr(config, "split_batches", False))


def refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """ConfigError naming an accelerate argument meshtrain does not implement (and why),
    or an argument accelerate does not have either. Default-valued ones pass."""
    for name, value in kwargs.items():
        if name in _REFUSED:
            if value in (None, False, [], {}) or (name == "even_batches" and value is True):
                continue
            raise ConfigError(f"Accelerator({name}={value!r}) is not supported: {_REFUSED[name]}")
        raise ConfigError(
            f"Accelerator({name}=...): no such argument (accelerate's are accepted or refused "
            "by name; see docs/accelerate.md)"
        )


def int_argument(name: str, value: Any, minimum: int) -> int:
    """An integer argument of ``Accelerator``, else a ConfigError naming it (not int()'s
    bare ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"Accelerator({name}={value!r}): expected an integer >= {minimum}")
    return value


def engine_config(config: dict[str, Any], loaders: list, topology):
    """The resolved ``Config`` for the Engine (batch sizes for this data-parallel size)."""
    from meshtrain.config import load_config

    d = dict(config)
    # the Accelerator counts the accumulation window itself (accelerate's accumulate()):
    # every engine steps whenever optimizer.step() is called at a synchronising step
    d["gradient_accumulation_steps"] = 1
    train = [dl for dl in loaders if dl.shuffle] or loaders
    mb = d.get("train_micro_batch_size_per_gpu")
    if mb in (None, "auto"):
        d["train_micro_batch_size_per_gpu"] = int(train[0].batch_size) if train else 1
    elif train and int(mb) != int(train[0].batch_size):
        raise ConfigError(
            f"train_micro_batch_size_per_gpu: the config says {mb} but the training "
            f'DataLoader has batch_size={train[0].batch_size}; make them agree or set "auto"'
        )
    # derived from the loader and the (engine's) accumulation of 1; the Accelerator's
    # global batch is batch_size x processes x gradient_accumulation_steps
    d.pop("train_batch_size", None)
    cfg = load_config(d, world_size=topology.world_size)
    return cfg.resolve_auto_defaults().resolve_batch_sizes(topology.dp_size)


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's torch/python/numpy (and CUDA) RNG states now: (tensors, JSON scalars)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        for i, t in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = t
    scalars = {"python": [py[0], list(py[1]), py[2]], "numpy": [kind, pos, has_gauss, cached]}
    return tensors, scalars


def save_rng_state(folder: Path, rank: int, state=None) -> None:
    """This rank's RNG states (``state``: what ``rng_state()`` captured earlier, e.g. at
    an asynchronous save; default now): tensors in safetensors, the rest in JSON, so
    loading never unpickles."""
    from safetensors.torch import save_file

    tensors, scalars = rng_state() if state is None else state
    save_file(tensors, str(folder / f"rng_state_{rank}.safetensors"))
    (folder / f"rng_state_{rank}.json").write_text(json.dumps(scalars), encoding="utf-8")


def load_rng_state(folder: Path, rank: int) -> bool:
    """Restore what ``save_rng_state`` wrote for ``rank``; False when there is nothing."""
    from safetensors.torch import load_file

    tensors_path = folder / f"rng_state_{rank}.safetensors"
    scalars_path = folder / f"rng_state_{rank}.json"
    if not (tensors_path.exists() and scalars_path.exists()):
        return False
    tensors = load_file(str(tensors_path))
    scalars = json.loads(scalars_path.read_text(encoding="utf-8"))
    torch.set_rng_state(tensors["torch"])
    version, state, gauss = scalars["python"]
    random.setstate((version, tuple(state), gauss))
    kind, pos, has_gauss, cached = scalars["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return True


__all__ = [
    "config_dict",
    "engine_config",
    "load_rng_state",
    "refuse_unsupported",
    "save_rng_state",
]
