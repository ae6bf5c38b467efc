"""Stage 3 with expert parallelism: both parts' ``ParamGatherer``\\s behind one face.

The dense part gathers its units over the replicas, the expert part over edp
(``parallel.zero.stage``); whoever makes parameters whole (evaluation, export,
``zero.GatheredParameters``) calls one object, which enters every part's in a fixed order,
so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from torch import nn


class Gatherers:
    """Several ``ParamGatherer``\\s, entered in the order given (module docstring)."""

    def __init__(self, gatherers) -> None:
        self.gatherers = gatherers

    @property
    def units(self) -> list:
        """Every gatherer's units, in order."""
        return [u for g in self.gatherers for u in g.units]

    @contextmanager
    def gathered(self, module: nn.Module | None = None):
        with ExitStack() as stack:
            for g in self.gatherers:
                stack.enter_context(g.gathered(module))
            yield

    @contextmanager
    def paused(self):
        with ExitStack() as stack:
            for g in self.gatherers:
                stack.enter_context(g.paused())
            yield

    def release_all(self) -> None:
        for g in self.gatherers:
            g.release_all()

    def gathered_bytes(self) -> int:
        return sum(g.gathered_bytes() for g in self.gatherers)

    def remove(self) -> None:
        for g in self.gatherers:
            g.remove()
