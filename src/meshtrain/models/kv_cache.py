"""The key/value-cache helpers' old address: they live in ``meshtrain.components.kv_cache``
(below ``parallel/``, which activation checkpointing imports them from); imports of this
path keep working."""

from meshtrain.components.kv_cache import CACHE_NAMES, is_kv_cache

__all__ = ["CACHE_NAMES", "is_kv_cache"]
