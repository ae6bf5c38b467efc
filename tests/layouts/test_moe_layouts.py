"""Mixtral at the MoE layouts issue 44 lifted, 20 fp32 AdamW steps against one process in
plain PyTorch (``ranks.reference``), on real gloo ranks:

* cp 2 x ep 2 (2 ranks; ep carved out of the cp ranks): the sequence cut into cp chunks,
  the experts split over the same two ranks, the router's auxiliary loss over the
  replica's whole rows (its counts summed over cp, ``parallel.experts.aux_loss``), both
  with ``loss.global_aux_loss`` (dp x cp) and by default (per replica: the cp group);
  at dp 1 both are what one process computes on the micro-batch;
* pp 2 x tp 2 (4 ranks), without and with sequence parallelism: the stages carry the
  router sums (``pipeline.router_aux``), under sequence parallelism each tp rank's shard's,
  summed over tp on the last stage;
* pp 2 x dp 2 x tp 2 on 8 ranks, longer job only;
* pp 2 x cp 2 (4 ranks), without and with ep 2 (ep carved out of the cp ranks), by
  default and with ``loss.global_aux_loss``: each cp rank's stages carry its chunk's
  router sums, combined over cp on the last stage (``pipeline.router_aux``).

Bound: per-step losses (relative) and the whole model (normwise) within
``trajectory(1e-2, 20)`` = 1.1e-4 (``tests/tolerance.py``): fp32 sums in another order
(tp partial sums, cp's attention merge, the all-to-all's regrouping, the aux sums'
all-reduce), the rule's row 3.
"""

from __future__ import annotations

import os

import pytest

from tests.layouts.matrix import build, label, table
from tests.layouts.test_matrix import check_group

STEPS = 20
DEFAULT_AUX = {"loss": {"global_aux_loss": False}}


@pytest.fixture(scope="module")
def rows() -> list:
    return table("mixtral")


def _jobs(rows, labels: list[str], extra: dict | None = None) -> list[tuple]:
    by_label = {label(lay): (lay, why) for lay, why in rows}
    out = []
    for lab in labels:
        layout, why = by_label[lab]
        assert why is None, (lab, why)
        out.append(("train", "mixtral", layout, *([extra] if extra else [])))
    return out


@pytest.mark.slow
def test_mixtral_cp2_ep2_matches_one_process(rows):
    jobs = _jobs(rows, ["cp2 ep2"]) + _jobs(rows, ["cp2 ep2"], DEFAULT_AUX)
    check_group(jobs, {"mixtral": rows}, STEPS)


@pytest.mark.slow
def test_mixtral_pp2_tp2_matches_one_process(rows):
    check_group(_jobs(rows, ["pp2 tp2", "pp2 tp2sp"]), {"mixtral": rows}, STEPS)


@pytest.mark.slow
def test_mixtral_pp2_cp2_matches_one_process(rows):
    jobs = _jobs(rows, ["pp2 cp2", "pp2 z1 cp2 ep2"]) + _jobs(rows, ["pp2 cp2 ep2"], DEFAULT_AUX)
    check_group(jobs, {"mixtral": rows}, STEPS)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MESHTRAIN_LONG_JOBS") != "1",
    reason="longer job: set MESHTRAIN_LONG_JOBS=1 (tests/layouts)",
)
def test_mixtral_pp2_dp2_tp2_matches_one_process(rows):
    check_group(_jobs(rows, ["pp2 dp2 z1 tp2", "pp2 dp2 z1 tp2sp ep2"]), {"mixtral": rows}, STEPS)


def test_moe_rows_with_padding_are_refused_under_cp():
    """A MoE model's batch that cp would pad (length not a multiple of 2 x cp), or whose
    mask has zeros, is refused by name: the routers would count the pads."""
    from types import SimpleNamespace

    import torch

    from meshtrain.errors import ConfigError
    from meshtrain.parallel.context.inputs import SequenceSharder

    model = build("mixtral")
    sharder = SequenceSharder(model, SimpleNamespace(size=2, rank=0), "transformers", True)
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ConfigError, match="context parallelism of a mixture-of-experts"):
        sharder.pre(model, (), {"input_ids": ids, "labels": ids})
    ids = torch.zeros(1, 8, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    with pytest.raises(ConfigError, match="pack the rows"):
        sharder.pre(model, (), {"input_ids": ids, "labels": ids, "attention_mask": mask})
    sharder.pre(model, (), {"input_ids": ids, "labels": ids})  # a multiple of 4, no pads
