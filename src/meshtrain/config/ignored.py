"""Keys meshtrain accepts but does not act on: found from their docstrings, warned about once.

A field whose documentation starts with "Accepted and ignored" loads (so a copied DeepSpeed
config works unchanged) but changes nothing. Setting one to anything but its default is
worth one warning naming it, so nobody believes a knob they turned took effect. A whole
ignored section (``flops_profiler``, ``wandb``, ...) given with ``enabled: false`` counts
as the default.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

MARK = "Accepted and ignored"


def _is_default(value: Any, default: Any) -> bool:
    if value == default:
        return True
    if default is None and isinstance(value, dict):  # an ignored section, switched off
        return value.get("enabled", True) is False
    return False


def ignored_settings(config: BaseModel, path: str = "") -> list[tuple[str, Any]]:
    """``[(dotted path, value), ...]`` of ignored fields set to a non-default value."""
    found: list[tuple[str, Any]] = []
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        where = f"{path}.{name}" if path else name
        if isinstance(value, BaseModel):
            found.extend(ignored_settings(value, where))
        elif (field.description or "").startswith(MARK) and not _is_default(value, field.default):
            found.append((where, value))
    return found


def warn_ignored(config: BaseModel, log: logging.Logger) -> list[str]:
    """Log one warning per ignored field set to a non-default value; returns the paths."""
    paths = []
    for where, value in ignored_settings(config):
        doc = _description(config, where)
        log.warning("config key %s = %r has no effect in meshtrain: %s", where, value, doc)
        paths.append(where)
    return paths


def _description(config: BaseModel, path: str) -> str:
    *parents, leaf = path.split(".")
    node = config
    for key in parents:
        node = getattr(node, key)
    return type(node).model_fields[leaf].description or ""


__all__ = ["MARK", "ignored_settings", "warn_ignored"]
