"""Every conformance test runs twice in the same session: against meshtrain's Trainer and
against transformers' own (``impl``), so a restated test that passes on both is faithful
to transformers' behaviour and proves meshtrain's."""

from __future__ import annotations

import pytest

from tests.conformance.trainer.peer import IMPLS, implementation


@pytest.fixture(params=IMPLS)
def impl(request):
    return implementation(request.param)
