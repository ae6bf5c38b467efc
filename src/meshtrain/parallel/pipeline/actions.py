"""The vocabulary of pipeline schedules: the kinds of action and ``Action`` itself.

``F`` forward, ``B`` backward (the input gradient only when ``W``, the weight gradient, is
split out), ``SEND_F``/``RECV_F`` an activation, ``SEND_B``/``RECV_B`` a gradient
(``schedules``' docstring says which stage each carries). Kept apart so the modules that
build orders (``schedules``, ``v_shape``) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)


@dataclass(frozen=True, order=True)
class Action:
    """One thing a rank does: ``kind`` of micro-batch ``mb`` on (virtual) stage ``stage``."""

    stage: int
    kind: str
    mb: int
    # a ``B`` whose ``W`` follows at once as one full backward (DualPipeV's unsplit
    # backwards, torch's ``FULL_BACKWARD``): the runtime runs both at ``B``. Not part of
    # the action's identity, so dependencies and validation see a plain ``B``.
    full: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}"
