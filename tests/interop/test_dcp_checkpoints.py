"""torch.distributed.checkpoint (DCP) in and out (issue 46): what FSDP2 saved with
``dcp.save`` resumes through ``engine.load_checkpoint`` at another rank count and ZeRO
stage and continues as FSDP2 itself continued; what meshtrain saves with
``checkpoint.format: dcp`` loads into FSDP2 with torch's own ``dcp.load`` and continues as
meshtrain itself continued (``tests/interop/dcp_ranks.py`` has the rank functions).

Tolerances (:mod:`tests.tolerance`):

* 2 ranks against FSDP2's 2 ranks, any ZeRO stage: **bitwise** (losses and final
  weights). The same rows per rank, the same per-rank mean loss, gradients averaged over
  the same two ranks (``(a + b) / 2`` and ``a / 2 + b / 2`` round alike: halving is exact),
  and torch's AdamW element by element on either side (the elements' grouping into FSDP2
  shards or meshtrain's flat buckets does not enter an element-wise update).
* 1 or 4 ranks: :func:`tests.tolerance.trajectory` of the 10 learning rates: the gradient
  is the mean over 8 rows summed in another grouping (one evaluation in another order per
  step), which Adam turns into parameter differences. Measured: see the test report in
  ``/work/notes`` (below 1.2e-7 relative at 1 and 4 ranks, bound 1.6e-5).
"""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from tests.harness import run_ranks
from tests.interop import dcp_ranks as R
from tests.tolerance import check_trajectory, trajectory

pytest.importorskip("transformers")
BOUND = trajectory([R.LR] * R.STEPS)


def assert_same(state: dict, ref: dict, what: str) -> None:
    """Bit for bit: every tensor of ``state`` equal to ``ref``'s."""
    assert state.keys() == ref.keys(), (what, sorted(set(state) ^ set(ref)))
    for k, v in ref.items():
        assert torch.equal(state[k], v), (what, k)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """FSDP2's two DCP saves (torchtitan's keys, a plain script's), its continuation."""
    out = tmp_path_factory.mktemp("fsdp2_dcp")
    return out, run_ranks(R.fsdp2_writes, 2, str(out), timeout=400)[0]


CASES = [  # (FSDP2's key layout, meshtrain's ranks, meshtrain's ZeRO stage)
    ("titan", 2, 1),
    ("plain", 2, 3),
    ("titan", 1, 0),
    ("titan", 4, 2),
]


@pytest.mark.parametrize("layout,ranks,stage", CASES)
def test_resume_fsdp2_dcp(fsdp2, layout, ranks, stage):
    out, ref = fsdp2
    got = run_ranks(R.meshtrain_resumes, ranks, str(out / layout), stage, timeout=400)[0]
    assert got["path"].endswith(layout)
    assert got["global_steps"] == R.SAVE_AT and got["step"] == float(R.SAVE_AT)
    assert got["lr"] == R.LR and got["weight_decay"] == R.WD
    what = f"FSDP2 (2 ranks, {layout} keys) resumed at {ranks} ranks ZeRO {stage}"
    if ranks == 2:  # the same reductions in the same order: bit for bit
        assert got["losses"] == ref["losses"], what
        assert_same(got["state"], ref["state"], what)
    else:
        check_trajectory(what, (got["losses"], got["state"]), (ref["losses"], ref["state"]), BOUND)


def test_from_pretrained_reads_dcp_weights(fsdp2):
    """``meshtrain.from_pretrained`` on FSDP2's DCP folder (config.json in the folder
    above) at ZeRO-3 on 2 ranks: the weights FSDP2 saved, bit for bit."""
    out, ref = fsdp2
    got = run_ranks(R.meshtrain_from_pretrained, 2, str(out / "titan"), 3, timeout=400)[0]
    assert_same(got["state"], ref["saved"], "from_pretrained on FSDP2's DCP")


def test_meshtrain_writes_dcp_that_fsdp2_loads(tmp_path):
    """meshtrain ZeRO-3 on 2 ranks saves DCP; FSDP2 on 2 ranks loads it with
    ``torch.distributed.checkpoint.load`` (torchtitan's keys) and its next 10 steps equal
    meshtrain's own continuation bit for bit; meshtrain at 1 rank resumes the same folder
    (through ``latest``) within the trajectory bound."""
    mine = run_ranks(R.meshtrain_writes, 2, str(tmp_path), timeout=400)[0]
    folder = tmp_path / "global_step3"
    assert mine["path"] == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    theirs = run_ranks(R.fsdp2_loads, 2, str(folder), timeout=400)[0]
    assert theirs["step"] == float(R.SAVE_AT)
    assert theirs["losses"] == mine["losses"]
    assert_same(theirs["state"], mine["state"], "FSDP2 continuing meshtrain's DCP")
    again = run_ranks(R.meshtrain_resumes, 1, str(tmp_path), 0, timeout=400)[0]
    assert again["global_steps"] == R.SAVE_AT and again["step"] == float(R.SAVE_AT)
    check_trajectory(
        "meshtrain's DCP (ZeRO-3, 2 ranks) resumed at 1 rank ZeRO 0",
        (again["losses"], again["state"]),
        (mine["losses"], mine["state"]),
        BOUND,
    )


def test_bad_dcp_inputs_are_named(fsdp2, tmp_path):
    """Real bad files, one line each naming the file and the fix: a truncated .distcp
    (never half-loaded), a .metadata pickle that needs code to run (it must not run), DCP
    metadata of another model, a folder of .distcp files without its .metadata."""
    out, _ = fsdp2
    truncated = tmp_path / "truncated"
    shutil.copytree(out / "titan", truncated)
    part = truncated / "__1_0.distcp"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    hostile = tmp_path / "hostile"
    shutil.copytree(out / "titan", hostile)
    with open(hostile / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own trusted file, to build the hostile one
    marker = tmp_path / "code_ran"
    md.planner_data = R.RunsCode(str(marker))
    (hostile / ".metadata").write_bytes(pickle.dumps(md))
    headless = tmp_path / "headless"
    shutil.copytree(out / "titan", headless)
    (headless / ".metadata").unlink()
    folders = {"truncated": str(truncated), "hostile": str(hostile), "headless": str(headless)}
    got = run_ranks(R.bad_inputs, 1, folders, str(tmp_path / "other"), timeout=400)[0]
    assert "__1_0.distcp: truncated" in got["truncated"], got
    assert "copy the DCP checkpoint again" in got["truncated"]
    assert ".metadata: the DCP metadata pickle names posix.system" in got["hostile"], got
    assert "never imports or runs" in got["hostile"]
    assert not marker.exists()  # refused before anything ran
    assert "is of another model" in got["other model"], got
    assert "model.embed_tokens.weight (64, 48) != (64, 32)" in got["other model"]
    assert "without its .metadata" in got["headless"], got
    for msg in got.values():
        assert msg is not None and "\n" not in msg
