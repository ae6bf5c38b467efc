"""An Accelerator attribute that one of its collaborators holds: ``accelerator.name``
reads ``accelerator.<holder>.name``, a property's value or a method bound to the
collaborator, so accelerate's flat API stays on the Accelerator while each job lives in
its own class. On the class it is the collaborator's own attribute (its docstring and
signature, for ``help`` and ``inspect``)."""

from __future__ import annotations

from typing import Any


class Forwarded:
    def __init__(self, holder: str, cls: type) -> None:
        self.holder = holder  # the Accelerator's attribute naming the collaborator
        self.cls = cls
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if not hasattr(self.cls, name):
            raise TypeError(f"{owner.__name__}.{name}: {self.cls.__name__} has no {name!r}")
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return getattr(self.cls, self.name)
        return getattr(getattr(obj, self.holder), self.name)


__all__ = ["Forwarded"]
