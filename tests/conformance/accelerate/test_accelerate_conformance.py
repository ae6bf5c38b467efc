"""accelerate's own test scripts, restated (``checks.py``), against accelerate 1.15 and
meshtrain in the same run, on 2 ranks (gloo).

One process group per library runs every check (each spawn costs the ranks' imports);
each check is then one pytest item per library, failing with that check's traceback from
the rank that failed. A check passing against accelerate shows the restatement is
faithful; passing against meshtrain shows meshtrain keeps accelerate's meaning.
"""

from __future__ import annotations

import pytest

from tests.conformance.accelerate.checks import CHECKS, IMPLS, run_all
from tests.harness import run_ranks


@pytest.fixture(scope="module")
def results() -> dict:
    return {impl: run_ranks(run_all, 2, impl, timeout=600) for impl in IMPLS}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_restated_accelerate_check(results, impl, check):
    for rank, per_rank in enumerate(results[impl]):
        assert per_rank[check] is None, f"rank {rank}:\n{per_rank[check]}"
