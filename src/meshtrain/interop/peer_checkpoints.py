"""Which framework wrote a checkpoint folder, and the source that reads it.

``engine.load_checkpoint(dir)`` asks here first: a folder another framework wrote is read
by that framework's source (``deepspeed_source``); meshtrain's own folders (a manifest, or
a ``latest`` naming a tag with one) and empty or absent ones go on to meshtrain's reader.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.interop.deepspeed_source import DeepSpeedSource, deepspeed_tag


def open_peer_checkpoint(load_dir, tag: str | None):
    """The opened source of a peer's checkpoint in ``load_dir`` (``tag``: the peer's tag,
    default its ``latest``), or None when it is not a peer's."""
    path = Path(load_dir)
    if not path.is_dir():
        return None
    folder = deepspeed_tag(path, tag)
    if folder is not None:
        return DeepSpeedSource(folder)
    return None
