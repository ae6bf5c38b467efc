"""Suite-wide hygiene: every test starts in a process with no torch.distributed group.

Some tests run a front door in the pytest process itself, as a user's one-process script
would (the conformance suites run ``meshtrain.Trainer`` beside ``transformers.Trainer``):
that joins a world-1 process group which the script's end would take down. The multi-rank
harness forks its ranks from this process and rightly refuses to while a group is live
(``launch.processes``: "cannot fork ranks: this process already has a process group"), so
a group left behind by one test would fail every later multi-rank test. Each test's group
ends with the test.

accelerate's process-wide state likewise: a test that builds an ``Accelerator`` (or a
transformers ``TrainingArguments`` asked for its ``.device``, which makes accelerate's
``PartialState``) in the pytest process leaves a one-process state that every rank forked
later inherits, so the real accelerate in a rank runs as one process. It ends with the
test too."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    yield
    import sys

    dist = sys.modules.get("torch.distributed")  # never import torch for a test that did not
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
