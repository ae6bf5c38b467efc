"""Seed 003's loop (examples/accelerate_mnist.py) on meshtrain's Accelerator reaches the
accuracy accelerate's own Accelerator reaches, within 0.02, on the same MNIST subset and
model, at 2 processes each.

Kept fast: the small MLP of the example, 2 epochs over 4,000 real digits. The tolerance
is the issue's: both libraries shuffle with a seed drawn from the global RNG at
``prepare`` (meshtrain deals accelerate's order: tests/conformance's
``dataloader_shuffled_order``), but the two runs here draw it from different RNG states,
so they are compared statistically only (both reach ~0.9 here).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.harness import run_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_mnist.py"


def _both() -> tuple[float, float]:
    spec = importlib.util.spec_from_file_location("accelerate_mnist", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ours = mod.train_accelerate("meshtrain", "small", 2)
    theirs = mod.train_accelerate("accelerate", "small", 2)
    return ours, theirs


def test_seed003_loop_reaches_accelerate_accuracy():
    results = run_ranks(_both, 2, timeout=600)  # the shared machine is loaded
    ours, theirs = results[0]
    assert results[1] == results[0]  # every rank computed the same gathered accuracy
    assert theirs > 0.8, theirs
    assert abs(ours - theirs) <= 0.02, (ours, theirs)
