"""Experiment tracking as accelerate's examples use it (``log_with="all"`` /
``"tensorboard"``, ``project_dir=``, ``init_trackers``, ``log``, ``end_training``), run in
this process against accelerate and meshtrain: the same files under ``project_dir`` (the
time-named hyperparameter folders compared by shape) and the same events in them
(scalars, text and ``add_scalars`` groups, read back with TensorBoard's own reader).
meshtrain's ``"jsonl"`` is checked on its own, and an uninstalled tracker is named.

Exact comparisons: the values logged are written as given (TensorBoard stores fp32, the
same rounding in both).
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from tests.conformance.accelerate.checks import accelerator

IMPLS = ("accelerate", "meshtrain")


@pytest.fixture(autouse=True)
def _no_accelerate_state_left_behind():
    """accelerate keeps its process state in class-level singletons; one left from this
    process's world of 1 would be inherited by ranks a later test forks from it."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


CONFIG = {"lr": 0.001, "batch_size": 4, "model": "tiny"}


def _script(impl: str, project_dir: str, log_with) -> None:
    acc = accelerator(impl, log_with=log_with, project_dir=project_dir)
    acc.init_trackers("glue_no_trainer", config=CONFIG)
    for step in range(3):
        acc.log({"train_loss": 1.0 / (step + 1), "epoch": step}, step=step)
    acc.log({"accuracy": 0.75, "note": "done", "f1": {"macro": 0.5, "micro": 0.7}}, step=3)
    acc.end_training()


def _files(root: str) -> list[str]:
    out = []
    for folder, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(folder, n), root)
            rel = re.sub(r"\d{10}\.\d+", "<time>", rel)  # add_hparams' time-named runs
            out.append(re.sub(r"events\.out\.tfevents\..*", "events", rel))
    return sorted(out)


def _events(root: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for folder, _, names in os.walk(root):
        if not any(n.startswith("events.out") for n in names):
            continue
        ea = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
        ea.Reload()
        key = re.sub(r"\d{10}\.\d+", "<time>", os.path.relpath(folder, root))
        found[key] = {
            "scalars": {
                t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]
            },
            "tensors": sorted(ea.Tags()["tensors"]),
        }
    return found


@pytest.mark.parametrize("log_with", ["all", "tensorboard", ["tensorboard"]])
def test_tensorboard_files_and_events_match_accelerate(tmp_path, log_with):
    got = {}
    for impl in IMPLS:
        root = str(tmp_path / impl / str(log_with))
        _script(impl, root, log_with)
        got[impl] = (_files(root), _events(root))
    assert got["meshtrain"][0] == got["accelerate"][0]
    assert got["meshtrain"][1] == got["accelerate"][1]
    scalars = got["meshtrain"][1]["glue_no_trainer"]["scalars"]
    assert scalars["train_loss"][2] == (2, pytest.approx(1 / 3, rel=1e-7))


def test_jsonl_tracker_writes_each_log_call(tmp_path):
    _script("meshtrain", str(tmp_path), ["jsonl", "tensorboard"])
    run = tmp_path / "glue_no_trainer"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "train_loss": 1.0, "epoch": 0}
    assert rows[3] == {
        "step": 3,
        "accuracy": 0.75,
        "note": "done",
        "f1": {"macro": 0.5, "micro": 0.7},
    }
    assert json.loads((run / "config.json").read_text()) == CONFIG
    assert any(p.name.startswith("events.out") for p in run.iterdir())


def test_a_tracker_meshtrain_does_not_write_is_named(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        _script("meshtrain", str(tmp_path), ["wandb", "tensorboard"])
    assert "'wandb' tracker is not written by meshtrain" in caplog.text
    assert (tmp_path / "glue_no_trainer").is_dir()


def test_trackers_without_a_directory_or_with_a_bad_name_are_refused():
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="project_dir"):
        accelerator("meshtrain", log_with="tensorboard")
    with pytest.raises(ConfigError, match="no such tracker"):
        accelerator("meshtrain", log_with="tensorbored", project_dir="x")
