"""Resume what accelerate 1.15 wrote (issue 46): meshtrain's ``Accelerator.load_state`` on
the folder accelerate's ``save_state`` wrote, at 1 and 2 processes and ZeRO 0, 1 and 3,
continues as accelerate's own uninterrupted run did (``tests/interop/accelerate_ranks.py``:
the script, the objects, the save mid-epoch and ``skip_first_batches``).

What is exact: what the folder restores (every process's torch, python and numpy RNG
streams, accelerate's ``step`` counter, the scheduler, the registered object, the
optimizer's step count and learning rates). At 2 processes, ZeRO 0 and 3, every loss of
the continuation and every final weight, bit for bit (rule 1 of ``tests/tolerance.py``):
each process computes the same shapes on the same rows from the same loaded weights; the
average over 2 processes is ``(a + b) / 2`` whichever way it is grouped (a sum of two is
commutative and halving is exact), DDP's buckets or meshtrain's flat (or reduce-scattered)
buffers alike; and AdamW runs torch's own per-element update on the same values (the
single-tensor kernel on CPU, for accelerate's parameters and meshtrain's master chunks).
At 1 process the first loss is the mean of 8 rows where the reference averaged two means
of 4: within :func:`tests.tolerance.evaluation`; the steps after it within
:func:`tests.tolerance.trajectory` of the schedule's learning rates, the final weights
normwise and per tensor (``check_weights``). Measured (1-min load 3.0): 2 processes 0
difference; 1 process 9.4e-8 relative on the losses, 3.2e-8 normwise on the weights
(bound 3.5e-5).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from meshtrain.interop.peer_pickles import numpy_arrays
from tests.harness import run_ranks
from tests.interop import accelerate_ranks as R
from tests.interop.deepspeed_ranks import RunsCode
from tests.tolerance import check, check_trajectory, check_weights, evaluation, trajectory

pytest.importorskip("accelerate")
LONG = os.environ.get("MESHTRAIN_LONG_JOBS") == "1"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """accelerate's folders (safetensors and .bin) and its uninterrupted run, 2 processes."""
    out = tmp_path_factory.mktemp("accelerate_save")
    return out, run_ranks(R.accelerate_writes, 2, str(out), timeout=600)


def _check(name: str, got: dict, ref: dict, rank_ref: dict, ranks: int) -> None:
    assert got["draws"] == rank_ref["at_save"]["draws"], name  # this process's RNG streams
    saved = ref["at_save"]  # custom_checkpoint_0.pkl and the scheduler: the main process's
    assert got["tally"]["seen"] == saved["tally"]["seen"] == R.SAVE_AT, name
    assert torch.equal(got["tally"]["total"], saved["tally"]["total"]), name
    assert got["tally"]["note"] == saved["tally"]["note"], name
    assert got["step"] == rank_ref["at_save"]["step"] == R.SAVE_AT, name
    assert got["scheduler"] == saved["scheduler"], name
    assert got["global_steps"] == R.SAVE_AT, name
    assert got["lrs"] == ref["lrs"], name
    if ranks == 2:  # the same operations in the same order: bit for bit (docstring)
        assert got["losses"] == ref["losses"], name
        assert got["state"].keys() == ref["state"].keys(), name
        for k, t in ref["state"].items():
            assert torch.equal(got["state"][k], t), (name, k)
        return
    first = abs(got["losses"][0] - ref["losses"][0]) / ref["losses"][0]
    check(f"{name}: first loss after the resume", first, evaluation())
    bound = trajectory(ref["lrs"])
    check_trajectory(name, (got["losses"], got["state"]), (ref["losses"], ref["state"]), bound)
    check_weights(name, got["state"], ref["state"], bound)


def test_resume_accelerate_folder_at_two_processes(written):
    out, ref = written
    got = run_ranks(R.meshtrain_resumes, 2, str(out / f"step_{R.SAVE_AT}"), [0, 3])
    for rank in (0, 1):
        for stage in (0, 3):
            name = f"accelerate (2 processes) resumed at 2 processes ZeRO {stage}, rank {rank}"
            _check(name, got[rank][stage], ref[0], ref[rank], 2)


def test_resume_accelerate_folder_at_one_process(written):
    """From the safetensors folder at ZeRO 0 and from the ``.bin`` one at ZeRO 1."""
    out, ref = written
    safe = run_ranks(R.meshtrain_resumes, 1, str(out / f"step_{R.SAVE_AT}"), [0])[0][0]
    _check("accelerate (2 processes) resumed at 1 process", safe, ref[0], ref[0], 1)
    pickled = run_ranks(R.meshtrain_resumes, 1, str(out / f"bin_{R.SAVE_AT}"), [1])[0][1]
    assert (out / f"bin_{R.SAVE_AT}" / "pytorch_model.bin").is_file()
    _check("accelerate .bin folder resumed at 1 process ZeRO 1", pickled, ref[0], ref[0], 1)


@pytest.mark.skipif(not LONG, reason="longer job: set MESHTRAIN_LONG_JOBS=1")
def test_resume_one_process_folder_at_two_processes(tmp_path):
    """accelerate on 1 process, meshtrain on 2 at ZeRO 2: rank 1 finds no
    ``random_states_1.pkl`` and keeps its own RNG streams (a warning, as accelerate only
    logs it); everything else as above, held to the 1-process bounds (the reference
    averaged 8 rows at once)."""
    ref = run_ranks(R.accelerate_writes, 1, str(tmp_path), timeout=600)[0]
    got = run_ranks(R.meshtrain_resumes, 2, str(tmp_path / f"step_{R.SAVE_AT}"), [2])
    assert not (tmp_path / f"step_{R.SAVE_AT}" / "random_states_1.pkl").exists()
    _check("accelerate (1 process) resumed at 2 processes ZeRO 2", got[0][2], ref, ref, 1)
    assert got[1][2]["draws"] != ref["at_save"]["draws"]  # rank 1's own streams


@pytest.mark.skipif(not LONG, reason="longer job: set MESHTRAIN_LONG_JOBS=1")
def test_resume_accelerate_folder_at_four_processes(written):
    """accelerate's 2-process folder resumed at 4 processes, ZeRO 2: ranks 0 and 1 get
    their saved RNG streams, ranks 2 and 3 keep their own (no random_states file, a
    warning); losses and weights within the 1-process bounds (each step's 8 rows are
    averaged in another grouping)."""
    out, ref = written
    got = run_ranks(R.meshtrain_resumes, 4, str(out / f"step_{R.SAVE_AT}"), [2], timeout=600)
    for rank in (0, 1):
        name = f"accelerate (2 processes) resumed at 4 processes ZeRO 2, rank {rank}"
        _check(name, got[rank][2], ref[0], ref[rank], 1)
    assert got[2][2]["draws"] != ref[0]["at_save"]["draws"]  # rank 2's own streams


def test_bad_accelerate_folders_are_named(written, tmp_path):
    """Real bad files, one line each naming the file and the fix: no optimizer.bin while
    the optimizer is prepared; an RNG pickle that would run code (it must not run); a
    registered object's state holding a type outside what weights_only allows; a loader
    file meshtrain's loaders have no use for; and the folder given to
    ``engine.load_checkpoint``, which points at ``load_state``."""
    out, _ = written
    folder = out / f"step_{R.SAVE_AT}"
    bad = {}
    for what in ("no optimizer", "hostile rng", "dated object", "sampler file"):
        bad[what] = tmp_path / what.replace(" ", "_")
        shutil.copytree(folder, bad[what])
    (bad["no optimizer"] / "optimizer.bin").unlink()
    torch.save({"epoch": 0}, bad["sampler file"] / "sampler.bin")
    bad["engine.load_checkpoint"] = folder
    marker = tmp_path / "code_ran"
    rng = bad["hostile rng"] / "random_states_0.pkl"
    with torch.serialization.safe_globals(numpy_arrays()):
        states = torch.load(rng, weights_only=True)
    states["note"] = RunsCode(str(marker))
    torch.save(states, rng)
    R.dated_state(str(bad["dated object"]))
    got = run_ranks(R.meshtrain_bad_inputs, 1, {k: str(v) for k, v in bad.items()})[0]
    assert "optimizer.bin: missing, and the optimizer is prepared" in got["no optimizer"]
    assert "copy the whole save_state folder" in got["no optimizer"]
    assert "random_states_0.pkl: the pickle needs" in got["hostile rng"], got
    assert "system" in got["hostile rng"] and "never does with a checkpoint" in got["hostile rng"]
    assert not marker.exists()  # refused before anything ran
    assert "custom_checkpoint_0.pkl: the pickle needs datetime.date" in got["dated object"]
    assert "state_dict() return tensors and plain values" in got["dated object"]
    assert "sampler.bin: accelerate's state of a seedable sampler" in got["sampler file"]
    assert "skip_first_batches" in got["sampler file"]
    assert "an accelerate save_state folder" in got["engine.load_checkpoint"]
    assert "accelerator.load_state(folder)" in got["engine.load_checkpoint"]
    for msg in got.values():
        assert msg is not None and "\n" not in msg
