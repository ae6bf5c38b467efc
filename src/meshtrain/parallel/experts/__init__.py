"""Mixture-of-experts layers and expert parallelism (ep).

The contract with the optimizer side (ZeRO over ``edp``, clipping, checkpoints): every
parameter whose tensor holds only this ep rank's experts after sharding carries
``param.meshtrain_expert = True``, and :func:`is_expert_param` reads it. Expert parameters
on different ep ranks hold different experts; every other parameter is replicated over
dp x cp as without ep.
"""

from __future__ import annotations

import torch

EXPERT_ATTR = "meshtrain_expert"


def is_expert_param(p: torch.Tensor) -> bool:
    """True for a parameter that holds only this ep rank's experts (set by EP sharding)."""
    return bool(getattr(p, EXPERT_ATTR, False))


def mark_expert_param(p: torch.Tensor) -> None:
    """Mark ``p`` as holding this ep rank's experts only (see :func:`is_expert_param`)."""
    setattr(p, EXPERT_ATTR, True)


__all__ = ["EXPERT_ATTR", "is_expert_param", "mark_expert_param"]
