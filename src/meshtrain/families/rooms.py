"""``ROOMS``: every family meshtrain knows, one room each, as one constant tuple.

The order is the order a mechanism tries them in where more than one could answer: the
pipeline's layouts are tried in room order (the Decoder's ``layers`` before the
Llama-style ``model.layers``), and messages list the families in it. Nothing adds to the
tuple at import or later: a new family is a new file in this package and one entry here
(docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

from meshtrain.families import (
    bert,
    decoder,
    gemma,
    gpt2,
    gpt_neox,
    llama,
    mistral,
    mixture_of_experts,
    olmo,
    qwen,
)
from meshtrain.families.layout import Layout
from meshtrain.families.room import Room

ROOMS: tuple[Room, ...] = (
    decoder.ROOM,
    llama.ROOM,
    qwen.ROOM,
    mistral.ROOM,
    gpt2.ROOM,
    bert.ROOM,
    mixture_of_experts.ROOM,
    gemma.ROOM,
    olmo.ROOM,
    gpt_neox.ROOM,
)


def class_names(obj: object) -> tuple[str, ...]:
    """``module.qualname`` of ``obj``'s class and of every class it derives from: a room
    names meshtrain's own classes this way, so a subclass is its parent's family (as
    ``isinstance`` would say) without this package importing the class."""
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__)


def is_one_of(obj: object, qualified: tuple[str, ...]) -> bool:
    """Whether ``obj`` is an instance of a class named in ``qualified`` (``class_names``)."""
    return bool(qualified) and any(n in qualified for n in class_names(obj))


def model_type(model: object) -> str | None:
    """transformers' ``config.model_type`` of ``model``, else None."""
    value = getattr(getattr(model, "config", None), "model_type", None)
    return value if isinstance(value, str) else None


def room_of(model: object) -> Room | None:
    """The room of ``model``: the one naming its class (or a base class), else the one
    naming its ``config.model_type``, else None."""
    for room in ROOMS:
        if is_one_of(model, room.classes):
            return room
    kind = model_type(model)
    for room in ROOMS:
        if kind is not None and kind in room.model_types:
            return room
    return None


def layouts() -> tuple[Layout, ...]:
    """The rooms' pipeline layouts in room order, each once (rooms may share one)."""
    out: list[Layout] = []
    for room in ROOMS:
        if room.layout is not None and room.layout not in out:
            out.append(room.layout)
    return tuple(out)


__all__ = ["ROOMS", "class_names", "is_one_of", "layouts", "model_type", "room_of"]
