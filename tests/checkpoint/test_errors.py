"""Damaged checkpoints and wrong models fail with a CheckpointError that names the file
(or the keys) and what failed. One-process saves (group=None) are enough here."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.checkpoint import CheckpointReader, save_shards
from meshtrain.errors import CheckpointError
from meshtrain.files import checksums
from tests.checkpoint.common import SHAPES, full_state, meta, shard


@pytest.fixture
def ckpt(tmp_path):
    save_dir = tmp_path / "ckpt"
    tensors, pieces = shard(full_state(0), 0, 1)
    rank_state = {"scheduler": {"last_epoch": 3}}
    save_shards(
        save_dir,
        "t1",
        group=None,
        tensors=tensors,
        pieces=pieces,
        meta=meta(),
        rank_state=rank_state,
    )
    return save_dir, save_dir / "t1" / "rank00000.safetensors"


def test_flipped_byte_is_a_checksum_error(ckpt):
    save_dir, f = ckpt
    data = bytearray(f.read_bytes())
    data[len(data) - 10] ^= 0xFF  # inside the tensor bytes: safetensors would not notice
    f.write_bytes(bytes(data))
    r = CheckpointReader(save_dir)  # sizes still match
    # each tensor is verified as it is read: the undamaged ones load with their exact values
    assert torch.equal(r.read_full("layer.b"), full_state(0)["param"]["layer.b"])
    with pytest.raises(CheckpointError, match="corrupted: its xxh3_64 checksum") as e:
        r.rank_tensor(0, "rng.torch")
    assert str(f) in str(e.value)
    assert "tensor 'rng.torch' (bytes " in str(e.value)  # the damaged tensor is named
    with pytest.raises(CheckpointError, match="tensor 'rng.torch' .* is corrupted"):
        CheckpointReader(save_dir).verify_all()  # every byte, whatever is read


def test_truncated_and_missing_files(ckpt):
    save_dir, f = ckpt
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(save_dir)
    assert str(f) in str(e.value) and f"{size - 100} bytes" in str(e.value)
    assert f"manifest says {size}" in str(e.value)
    f.unlink()
    with pytest.raises(CheckpointError, match="is missing") as e:
        CheckpointReader(save_dir, "t1")
    assert str(f) in str(e.value)


def test_damaged_manifest(ckpt):
    save_dir, _ = ckpt
    m = save_dir / "t1" / "manifest.json"
    good = json.loads(m.read_text())

    def write(d):
        # a manifest that passes its own checksum (a writer bug, not disk damage), so the
        # structural checks behind the seal are what must catch it
        d = {k: v for k, v in d.items() if k != "_checksum"}
        m.write_text(checksums.seal(json.dumps(d)))

    m.write_text(m.read_text()[:200])
    with pytest.raises(CheckpointError, match="cannot be read as JSON") as e:
        CheckpointReader(save_dir)
    assert str(m) in str(e.value)

    pieces = good["ranks"][0]["pieces"]
    # exp_avg of embed.weight is stored as runs of 3: [0, 3), [3, 6), ...
    first = next(i for i, p in enumerate(pieces) if p["state"] == "exp_avg")
    bad = json.loads(json.dumps(good))
    bad["ranks"][0]["pieces"][first + 1]["start"] = 2  # [2, 5) overlaps [0, 3)
    write(bad)
    with pytest.raises(CheckpointError, match=r"'embed.weight' \(state 'exp_avg'\) overlap"):
        CheckpointReader(save_dir)

    bad = json.loads(json.dumps(good))
    del bad["ranks"][0]["pieces"][first]
    write(bad)
    with pytest.raises(CheckpointError, match=r"leave elements \[0, 3\) of 66 uncovered"):
        CheckpointReader(save_dir)

    bad = json.loads(json.dumps(good))
    del bad["ranks"][0]["pieces"][0]
    write(bad)
    with pytest.raises(CheckpointError, match="'embed.weight' has no 'param' pieces"):
        CheckpointReader(save_dir)

    bad = json.loads(json.dumps(good))
    bad["format_version"] = 99
    write(bad)
    with pytest.raises(CheckpointError, match="upgrade meshtrain"):
        CheckpointReader(save_dir)

    bad = json.loads(json.dumps(good))
    bad["ranks"][0]["pieces"][0]["key"] = "gone"  # manifest and file disagree
    write(bad)
    with pytest.raises(CheckpointError, match="of key 'gone', which has shape None"):
        CheckpointReader(save_dir).read("embed.weight")


def test_wrong_model_lists_keys(ckpt):
    save_dir, _ = ckpt
    r = CheckpointReader(save_dir)
    model = dict(SHAPES)
    del model["norm.scale"]
    model["layer.w"] = (3, 5)
    model["layer.extra"] = (4,)
    with pytest.raises(CheckpointError) as e:
        r.check_model(model)
    msg = str(e.value)
    assert "missing in checkpoint (1): layer.extra" in msg
    assert "unexpected in checkpoint (not in the model) (2): norm.scale, head.weight" in msg
    assert "shape mismatches (1): layer.w: checkpoint (5, 3) vs model (3, 5)" in msg
    assert str(save_dir / "t1") in msg

    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        r.read("nope")
    with pytest.raises(CheckpointError, match="no state 'momentum_buffer' stored"):
        r.read("layer.w", "momentum_buffer")
    with pytest.raises(CheckpointError, match="out of range"):
        r.read("layer.b", start=5, numel=3)
    with pytest.raises(CheckpointError, match="no tensor 'nope'; keys there"):
        r.rank_tensor(0, "nope")
    assert r.rank_state(0) == {"scheduler": {"last_epoch": 3}}
    with pytest.raises(CheckpointError, match="rank 1 out of range"):
        r.rank_state(1)


def test_nothing_to_load(tmp_path):
    with pytest.raises(CheckpointError, match="neither manifest.json nor a 'latest' file"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="is not a directory"):
        CheckpointReader(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="tag 'x' not found"):
        CheckpointReader(tmp_path, "x")


def test_rank_state_must_be_json(tmp_path):
    tensors, pieces = shard(full_state(0), 0, 1)
    for state, where in (
        ({"sched": {"lr": torch.tensor(1.0)}}, r"rank_state \(rank 0\)\.sched\.lr"),
        ({"opt": {1: 2}}, r"rank_state \(rank 0\)\.opt: key 1 is a int"),
        ({"rng": [1, object()]}, r"rank_state \(rank 0\)\.rng\[1\]"),
    ):
        with pytest.raises(CheckpointError, match=where):
            save_shards(
                tmp_path,
                "t",
                group=None,
                tensors=tensors,
                pieces=pieces,
                rank_state=state,
                meta=meta(),
            )
