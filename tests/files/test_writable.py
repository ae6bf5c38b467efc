"""The one writing path: an output that cannot be written is refused before any work, in
one line naming the path and the fix. Real folders: missing parents, read-only folders,
files in the way, and a disk too full for what the caller needs."""

from __future__ import annotations

import os

import pytest
import torch

from meshtrain.checkpoint import Piece, save_shards
from meshtrain.errors import CheckpointError, ConfigError, DataError
from meshtrain.files.writable import check_writable


def test_missing_parents_are_fine_when_creatable(tmp_path):
    assert check_writable(tmp_path / "a" / "b" / "c", ConfigError) == tmp_path / "a" / "b" / "c"
    assert not (tmp_path / "a").exists()  # checking creates nothing
    assert not [p for p in tmp_path.iterdir()]  # and leaves no probe behind


def test_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"output folder .*/f is a file, not a folder"):
        check_writable(tmp_path / "f", ConfigError)
    with pytest.raises(
        ConfigError, match=r"/f is a file, so the folder .*/f/sub cannot be created"
    ):
        check_writable(tmp_path / "f" / "sub", ConfigError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(
            DataError, match=r"--out .*/ro/store: cannot write in .*/ro \(to create"
        ):
            check_writable(ro / "store", DataError, what="token store folder", flag="--out")
    finally:
        ro.chmod(0o755)


def test_read_only_folder_via_a_read_only_mount_stand_in(tmp_path):
    """As root (CI containers) permissions do not stop writes; /proc is a filesystem
    nobody can create files in, so it stands in for a read-only mount."""
    with pytest.raises(ConfigError) as e:
        check_writable("/proc/meshtrain-out", ConfigError, what="TrainingArguments.output_dir")
    msg = str(e.value)
    assert "\n" not in msg and "cannot write in /proc" in msg and "chmod u+w /proc" in msg


def test_full_disk(tmp_path):
    with pytest.raises(CheckpointError, match=r"only .* free on the disk holding .*, .* needed"):
        check_writable(tmp_path, CheckpointError, need_bytes=1 << 62)


def test_save_shards_refuses_an_unwritable_folder_before_writing():
    t = {"w": torch.zeros(4)}
    meta = {"tensors": {"w": {"shape": [4], "dtype": "float32", "kind": "param"}}}
    with pytest.raises(CheckpointError) as e:
        save_shards("/proc/ck", "t", group=None, tensors=t,
                    pieces=[Piece("w", "param", "w", 0, 0, 4)], meta=meta)  # fmt: skip
    assert "checkpoint folder /proc/ck: cannot write in /proc" in str(e.value)
    assert "Traceback" not in str(e.value)
