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
test too.

A hang reads as a report: each test's pytest-timeout deadline is published to the
multi-rank harness (``tests/harness.py``), which ends its wait on the ranks before it, so a
hung rank's Python stacks reach the failure instead of pytest-timeout's bare traceback of
the parent waiting on a queue."""

from __future__ import annotations

import os
import time

import pytest

from tests.harness import TEST_DEADLINE_ENV


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker and marker.args else item.config.getoption("timeout", 0)
    os.environ[TEST_DEADLINE_ENV] = str(time.time() + float(limit)) if limit else ""
    yield


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
