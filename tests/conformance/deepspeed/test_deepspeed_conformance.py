"""DeepSpeed's engine-API and dynamic-loss-scaler unit tests, restated (``checks.py``),
against deepspeed 0.19.8 and meshtrain in the same run, on 2 ranks (gloo; DeepSpeed with
``DS_ACCELERATOR=cpu``).

One process group per library runs every check; each check is one pytest item per
library, failing with that check's traceback. A check passing against DeepSpeed shows the
restatement is faithful; passing against meshtrain shows meshtrain keeps DeepSpeed's
meaning.
"""

from __future__ import annotations

import pytest

from tests.conformance.deepspeed.checks import CHECKS, IMPLS, run_all
from tests.harness import run_ranks


@pytest.fixture(scope="module")
def results() -> dict:
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return {impl: run_ranks(run_all, 2, impl, timeout=600, env=env) for impl in IMPLS}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_restated_deepspeed_check(results, impl, check):
    for rank, per_rank in enumerate(results[impl]):
        assert per_rank[check] is None, f"rank {rank}:\n{per_rank[check]}"
