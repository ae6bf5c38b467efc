"""One layout's prediction: memory, step time, throughput and MFU, and whether it fits."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.plan.host_memory import HostLoad
from meshtrain.plan.layout import Layout
from meshtrain.plan.memory import MemoryBreakdown
from meshtrain.plan.step_time import StepTime

__all__ = ["Prediction"]


@dataclass(frozen=True)
class Prediction:
    """What the planner predicts for ``layout`` under a memory limit of ``limit`` bytes."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    seq: int
    flops_per_token: float
    peak_flops: float
    limit: int
    host: HostLoad  # host RAM per rank while loading (plan.host_memory)
    padding: float = 0.0  # the share of the rows' slots that is padding (no packed rows)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.limit

    @property
    def tokens_per_s(self) -> float:
        """Tokens of data (padding not counted) per second per device."""
        slots = self.layout.global_batch * self.seq / self.time.total / self.layout.world
        return slots * (1.0 - self.padding)

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_s / self.peak_flops

    @property
    def bottleneck(self) -> str:
        if not self.fits:
            return "memory"
        return self.time.bottleneck
