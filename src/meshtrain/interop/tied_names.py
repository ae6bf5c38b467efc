"""The name a peer's file stores a tied weight under.

A peer writes a tied weight once (an embedding and its LM head: one tensor, one entry of
the optimizer), under whichever of its names the peer kept. The engine asks for each
canonical name; the readers look it up here, with the model's ``{alias: canonical}``.
"""

from __future__ import annotations

from collections.abc import Container, Mapping


def stored_name(name: str, aliases: Mapping[str, str], stored: Container[str]) -> str | None:
    """``name`` if ``stored`` holds it, else the other name of its tie that it holds, or
    None."""
    if name in stored:
        return name
    for alias, canon in aliases.items():
        if canon == name and alias in stored:
            return alias
        if alias == name and canon in stored:
            return canon
    return None


__all__ = ["stored_name"]
