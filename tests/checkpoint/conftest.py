from __future__ import annotations

import pytest

from tests.checkpoint import ranks
from tests.harness import run_ranks


@pytest.fixture(scope="session")
def two_rank_checkpoint(tmp_path_factory):
    """A checkpoint saved by 2 gloo ranks (tests.checkpoint.common layouts, seed 0), and
    what each rank saw when it then tried three invalid saves."""
    save_dir = tmp_path_factory.mktemp("ckpt2")
    results = run_ranks(ranks.save_and_misuse, 2, str(save_dir))
    return save_dir, results
