"""``split_between_processes`` and the process-selecting decorators, with accelerate's
meanings (``PartialState.split_between_processes``, ``on_main_process``, ...).

Splitting: ``n`` items over ``P`` processes gives process ``i`` a contiguous slice; the
first ``n mod P`` processes get one item more (``ceil(n / P)``), the rest ``floor(n / P)``.
With ``apply_padding=True`` every process gets ``ceil(n / P)`` items, the short ones
padded: a tensor with copies of the whole input's last row, a list with copies of its
own last item (accelerate's choices), so that a later ``gather`` has equal shapes. Lists, tuples, tensors
(along dim 0) and dicts of those (each value split the same way) are split.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch


def _length(inputs: Any) -> int:
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) != 1:
            raise ValueError(
                "split_between_processes: every value of the dict must have the same length, "
                f"got lengths {sorted(lengths)}"
            )
        return lengths.pop()
    return len(inputs)


def split(inputs: Any, num_processes: int, index: int, apply_padding: bool) -> Any:
    """This process's share of ``inputs`` (module docstring)."""
    if num_processes == 1:
        return inputs
    n = _length(inputs)
    per, extra = divmod(n, num_processes)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)

    def one(x: Any) -> Any:
        part = x[start:end]
        if not apply_padding:
            return part
        want = math.ceil(n / num_processes)
        if len(part) >= want:
            return part
        if isinstance(x, torch.Tensor):  # padded with the whole input's last row
            return torch.cat([part, *([x[-1:]] * (want - len(part)))], dim=0)
        return part + type(part)([part[-1]] * (want - len(part)))  # with its own last

    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return one(inputs)


def run_on(selected: Callable[[], bool], function: Callable) -> Callable:
    """``function`` that runs only where ``selected()`` is True (else returns None)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if selected():
            return function(*args, **kwargs)
        return None

    return wrapper


__all__ = ["run_on", "split"]
