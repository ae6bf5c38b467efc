"""The refusals outside the matrix (``refusals.py``): each row initialized on real ranks,
one 4-rank group, raises a ``ConfigError`` that starts with the row's line, on every rank,
and names a config key first (the matrix's rule, ``test_matrix.KEY``)."""

from __future__ import annotations

from tests.harness import run_ranks
from tests.layouts.refusals import REFUSALS, WORLD, raised
from tests.layouts.test_matrix import KEY


def test_every_refusal_outside_the_matrix_is_raised_by_name():
    per_rank = run_ranks(raised, WORLD, timeout=600)
    for rank, lines in enumerate(per_rank):
        for row, line in zip(REFUSALS, lines, strict=True):
            assert line.startswith(row.line), (rank, row.what, line)
            assert KEY.match(line), (row.what, line)
