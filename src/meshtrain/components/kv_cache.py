"""What a transformers key/value cache looks like, recognised by behaviour, not by name.

transformers has renamed the cache over its releases: a block's argument was
``layer_past``, ``past_key_value``, ``past_key_values`` and, from 5.24, ``cache``; a
model's output field went from ``past_key_values`` to ``cache``. Code that must drop the
cache (a checkpointed block recomputed in backward, the Trainer's predictions) asks
``is_kv_cache`` about the value, and keeps the names only for the legacy tuple caches that
have no class of their own. transformers is never imported here.
"""

from __future__ import annotations

from typing import Any

CACHE_NAMES = ("past_key_values", "past_key_value", "layer_past", "cache")


def is_kv_cache(value: Any) -> bool:
    """True for a transformers ``Cache`` object (``DynamicCache``, ``EncoderDecoderCache``, ...)."""
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers")
        for c in type(value).__mro__
    )


__all__ = ["CACHE_NAMES", "is_kv_cache"]
