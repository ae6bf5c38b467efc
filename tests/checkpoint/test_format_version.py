"""The manifest's format_version (issue 32): a reader refuses a newer format by name, with
the version that wrote it and the fix, and reads every older one. An "older meshtrain" is
simulated by this code with the previous version constant (1), which is exactly the check
the releases before version 2 ran."""

from __future__ import annotations

import json

import pytest
import torch

import meshtrain
from meshtrain.checkpoint import CheckpointReader, manifest, save_shards
from meshtrain.errors import CheckpointError
from meshtrain.files import checksums
from tests.checkpoint.common import full_state, meta, shard


@pytest.fixture
def ckpt(tmp_path):
    tensors, pieces = shard(full_state(3), 0, 1)
    save_shards(tmp_path, "t", group=None, tensors=tensors, pieces=pieces, meta=meta())
    return tmp_path, tmp_path / "t" / "manifest.json"


def _rewrite(path, edit, seal=True):
    data = json.loads(path.read_text())
    data.pop("_checksum")
    edit(data)
    text = manifest.dumps(data)
    path.write_text(checksums.seal(text) if seal else text)


def test_new_manifests_say_version_2_and_who_wrote_them(ckpt):
    _, m = ckpt
    data = json.loads(m.read_text())
    assert data["format_version"] == manifest.FORMAT_VERSION == 2
    assert data["meshtrain_version"] == meshtrain.__version__
    assert "checksum" in data["ranks"][0] and "sha256" not in data["ranks"][0]


def test_an_older_reader_refuses_the_new_format_by_name(ckpt, monkeypatch):
    save_dir, m = ckpt
    monkeypatch.setattr(manifest, "FORMAT_VERSION", 1)  # the reader before issue 32
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(save_dir)
    msg = str(e.value)
    assert msg.startswith(f"{m}: checkpoint format_version 2 (written by meshtrain ")
    assert "is newer than this meshtrain" in msg and "(format_version 1 to 1)" in msg
    assert "upgrade meshtrain (pip install -U meshtrain)" in msg


def test_a_newer_format_is_refused_and_a_nonsense_one_named_as_damage(ckpt):
    save_dir, m = ckpt
    _rewrite(m, lambda d: d.update(format_version=3, meshtrain_version="9.0"))
    with pytest.raises(
        CheckpointError,
        match=r"format_version 3 \(written by meshtrain 9\.0\) "
        r"is newer than this meshtrain .* \(format_version 1 to 2\); upgrade",
    ):
        CheckpointReader(save_dir)
    for bad in (0, "2", True, None):
        _rewrite(m, lambda d, v=bad: d.update(format_version=v))
        with pytest.raises(CheckpointError, match="is not a version of the meshtrain checkpoint"):
            CheckpointReader(save_dir)


def test_version_1_manifests_still_load(ckpt):
    """Both kinds of version-1 manifest: per-tensor records unsealed (the last version-1
    writers) and whole-file sha256 (the first ones; tests/checkpoint/test_integrity.py)."""
    save_dir, m = ckpt
    want = CheckpointReader(save_dir).read_full("layer.w")
    _rewrite(m, lambda d: (d.update(format_version=1), d.pop("meshtrain_version")), seal=False)
    r = CheckpointReader(save_dir)
    assert r.world_size == 1 and torch.equal(r.read_full("layer.w"), want)


def test_version_2_must_be_sealed_and_carry_records(ckpt):
    save_dir, m = ckpt
    raw = m.read_bytes()
    _rewrite(m, lambda d: None, seal=False)  # the seal removed: an edit, or damage
    with pytest.raises(
        CheckpointError,
        match=r"format_version 2 manifests end with their own "
        r"checksum .* and this one has none",
    ):
        CheckpointReader(save_dir)
    assert CheckpointReader(save_dir, verify=False).world_size == 1  # inspect anyway
    m.write_bytes(raw)

    def to_sha(d):
        d["ranks"][0].pop("checksum")
        d["ranks"][0]["sha256"] = "0" * 64

    _rewrite(m, to_sha)
    with pytest.raises(CheckpointError, match=r"ranks\[0\]\.checksum is missing or malformed"):
        CheckpointReader(save_dir)
