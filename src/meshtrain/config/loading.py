"""Reading config files and ``load_config``: the one entry point from user input to Config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshtrain.config._errors import show
from meshtrain.config._types import AUTO
from meshtrain.config.resolve import BATCH_KEYS
from meshtrain.config.root import Config
from meshtrain.errors import ConfigError
from meshtrain.files.structured import parse_json, parse_yaml
from meshtrain.files.text import decode, read_bytes


def detect_world_size() -> int | None:
    """World size from the launcher's environment: WORLD_SIZE, else SLURM_NTASKS, else None."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        raw = os.environ.get(var)
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"environment variable {var}={raw!r} is not an integer") from None
            if value < 1:
                raise ConfigError(f"environment variable {var}={raw!r} must be >= 1")
            return value
    return None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a JSON (or .yaml/.yml) file through the one reading path (``meshtrain.files``):
    encodings, duplicate keys and empty files are refused with file, line and column."""
    path = Path(path)
    kind = "YAML" if path.suffix.lower() in (".yaml", ".yml") else "JSON"
    empty = (
        f"{path}: the {kind} config file is empty; write the keys to set, or {{}} "
        "to keep every default"
    )
    # an empty file is a mistake (a truncated write, the wrong path), in YAML as in JSON;
    # a config with every default is written as {} on purpose
    raw = read_bytes(path, ConfigError, "config file")
    text = decode(raw, str(path), ConfigError, what="config file", allow_empty=True)
    if not text.strip():
        raise ConfigError(empty)
    fix = "fix the config file"
    if kind == "YAML":
        data = parse_yaml(text, str(path), ConfigError, fix=fix)
    else:
        data = parse_json(text, str(path), ConfigError, fix=fix)
    if data is None:
        raise ConfigError(empty)
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a {kind} mapping of keys, not {type(data).__name__}"
        )
    return data


def load_config(
    source: Config | dict[str, Any] | str | Path, *, world_size: int | None = None
) -> Config:
    """Load and validate a config from a dict, a JSON/YAML file path, or a Config (returned as is).

    Batch sizes are resolved for ``dp = world_size / (pp * tp)`` unless one of them is "auto";
    ``world_size`` defaults to $WORLD_SIZE, then $SLURM_NTASKS, then pp * tp (dp = 1).
    """
    if isinstance(source, Config):
        return source
    origin = None
    if isinstance(source, (str, Path)):
        origin = str(source)
        data = read_config_file(source)
    elif isinstance(source, dict):
        data = source
    else:
        raise ConfigError(
            f"config source {type(source).__name__} is not allowed; pass a dict, a path to a "
            ".json/.yaml file, or a Config"
        )
    try:
        config = Config.from_dict(data)
        mesh = config.mesh
        model_parallel = mesh.pipeline_parallel_size * mesh.tensor_parallel_size
        if world_size is None:
            world_size = detect_world_size() or model_parallel
        elif isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size {show(world_size)} is not allowed; use an integer >= 1")
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by mesh.pipeline_parallel_size "
                f"{mesh.pipeline_parallel_size} * mesh.tensor_parallel_size "
                f"{mesh.tensor_parallel_size} = {model_parallel}; pick sizes whose product "
                f"divides {world_size} (divisors: {_divisors(world_size)}), or launch a "
                f"multiple of {model_parallel} processes"
            )
        if not any(getattr(config, k) == AUTO for k in BATCH_KEYS):
            config = config.resolve_batch_sizes(world_size // model_parallel)
    except ConfigError as exc:
        if origin is None:
            raise
        raise ConfigError(
            "\n".join(f"{origin}: {line}" for line in str(exc).splitlines())
        ) from None
    return config


def _divisors(n: int) -> str:
    found = [d for d in range(1, min(n, 10**6) + 1) if n % d == 0]
    return ", ".join(map(str, found[:12])) + (", ..." if len(found) > 12 else "")
