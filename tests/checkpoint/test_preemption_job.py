"""One trial of each campaign of ``tests/faults/preemption.py`` on real launched jobs.

* SIGTERM to a 2-rank ``meshtrain train``: exit code 75, the launcher's "pre-empted,
  checkpoint saved at step N" line, N the step running at the signal or the next, and the
  rerun ends with the uninterrupted run's final loss exactly (the same fp32 operations in
  the same order on the same data; the checkpoint holds every bit of the state).
* SIGKILL of a rank while ``checkpoint.async_save`` writes in the background: ``latest``
  names a checkpoint whose files all verify.

The 10-trial campaigns are the script's; docs/checkpoints.md reports them.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from tests.faults import preemption


@pytest.mark.skipif(
    importlib.util.find_spec("snownlp") is None, reason='needs pip install "meshtrain[examples]"'
)
def test_sigterm_to_meshtrain_train_saves_and_resumes_exactly(tmp_path):
    steps = 60
    ref = preemption.reference(tmp_path, steps)
    row = preemption.preempt_trial(tmp_path, "t", 20, steps, ref)
    assert row["exit_code"] == 75, row["stderr_tail"]
    assert "pre-empted, checkpoint saved at step" in row["launcher_line"], row
    assert row["within_one_step"], row
    assert row["rerun_exit"] == 0, row["rerun_stderr_tail"]
    assert row["final_loss"] == ref, row


def test_sigkill_during_background_write_leaves_latest_loadable(tmp_path):
    row = preemption.kill_async_trial(tmp_path, "t", random.Random(3))
    assert row["latest"] is not None and row["loadable"], row
