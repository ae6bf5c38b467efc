"""torch.compile through the config, composed with data parallelism and ZeRO-3.

The "eager" backend runs dynamo's captured graphs with the same eager kernels, so a
compiled run must equal the uncompiled one exactly; what is tested is that the config
reaches ``torch.compile`` and that tracing composes with the gradient hooks (stage 0) and
with ZeRO-3's parameter swapping hooks (stage 3). Inductor itself is torch's business.
"""

from __future__ import annotations

import pytest

from tests.distributed.training import engine_run
from tests.harness import run_ranks


def _compiled():
    out = {}
    for stage in (0, 3):
        zero = {"zero_optimization": {"stage": stage}}
        plain = engine_run("decoder", 2, 2, 1, zero)
        compiled_cfg = {
            **zero,
            "compile": {"enabled": True, "backend": "eager", "options": {"unused": 1}},
        }
        compiled = engine_run("decoder", 2, 2, 1, compiled_cfg)
        out[stage] = (plain[0], compiled[0])
    full = {"compile": {"enabled": True, "backend": "eager", "fullgraph": True}}
    out["fullgraph"] = (engine_run("plain", 2, 2, 1)[0], engine_run("plain", 2, 2, 1, full)[0])
    return out


@pytest.mark.slow
def test_compiled_engine_equals_eager():
    out = run_ranks(_compiled, 2)[0]
    for key, (plain, compiled) in out.items():
        assert plain == compiled, key
