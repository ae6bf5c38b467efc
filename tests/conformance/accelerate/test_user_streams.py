"""A user's random streams and loader order under meshtrain equal accelerate's, on 1 and 2
processes (``streams.py`` runs the same code against both libraries).

Tolerances: loader orders, the user generator's state and the global RNG digests are
compared exactly (they are integers). Parameters after 3 epochs of AdamW with dropout: on
one process bitwise (the same batches, masks and fp32 operations in the same order); at 2
processes (measured 0.0 here) the two libraries average the gradients in different sums
(DDP's bucket divides before its all-reduce, meshtrain's flat buffer after), a rounding
of about 2^-24 relative per gradient, which AdamW's normalised update carries into the
weights: the model normwise and each tensor within ``trajectory(1e-2, 15)`` /
``per_tensor`` (``tests/tolerance.py``; not elementwise: a gradient that cancels to ~eps
flips its update). ``no_sync``'s local and synced gradients (one evaluation each, the
synced ones averaged in another order): ``gradient()`` per tensor.
"""

from __future__ import annotations

import pytest
import torch

from tests.conformance.accelerate.streams import run
from tests.harness import run_ranks
from tests.tolerance import check_weights, gradient, relative, trajectory

IMPLS = ("accelerate", "meshtrain")


@pytest.fixture(scope="module", params=(1, 2), ids=("1proc", "2proc"))
def results(request) -> dict:
    world = request.param
    return {"world": world, **{impl: run_ranks(run, world, impl, timeout=300) for impl in IMPLS}}


def test_loader_orders_and_generator_state_match_accelerate(results):
    for rank, (peer, ours) in enumerate(
        zip(results["accelerate"], results["meshtrain"], strict=True)
    ):
        for key, want in peer["orders"].items():
            assert ours["orders"][key] == want, f"rank {rank}: {key}"


def test_break_starts_a_new_epoch_with_a_new_order(results):
    for per_rank in results["meshtrain"]:
        orders = per_rank["orders"]
        assert orders["after break"] not in orders["generator epochs"]
        assert orders["default after break"] not in orders["default epochs"]


@pytest.mark.parametrize("gas", (1, 2))
def test_training_with_own_generator_matches_accelerate(results, gas):
    for rank, (peer, ours) in enumerate(
        zip(results["accelerate"], results["meshtrain"], strict=True)
    ):
        assert ours["train", gas]["prepare drew nothing"]
        assert ours["train", gas]["rng end"] == peer["train", gas]["rng end"], rank
        want, got = peer["train", gas]["params"], ours["train", gas]["params"]
        assert sorted(got) == sorted(want)
        if results["world"] == 1:
            for k in want:
                assert torch.equal(got[k], want[k]), f"gas {gas} {k}"
        check_weights(f"rank {rank} gas {gas}", got, want, trajectory(1e-2, 15))


def test_model_no_sync_keeps_gradients_local(results):
    for rank, (peer, ours) in enumerate(
        zip(results["accelerate"], results["meshtrain"], strict=True)
    ):
        for key in ("local", "synced"):
            for p, q in zip(peer["no_sync"][key], ours["no_sync"][key], strict=True):
                assert relative(q, p) <= gradient(), f"rank {rank} {key}"
