"""Checksums of checkpoints and exports (issue 32), on real files: the sealed manifest, the
per-tensor records of rank files, older sha256 manifests, the inspect-anyway switch,
consolidated exports and folders meshtrain did not write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from meshtrain.checkpoint import CheckpointReader, save_shards
from meshtrain.checkpoint.consolidate import consolidate
from meshtrain.checkpoint.tensor_files import check_folder, verify_export
from meshtrain.errors import CheckpointError, ServeError
from meshtrain.files import checksums
from tests.checkpoint.common import full_state, meta, shard


def _save(save_dir, tag, seed):
    tensors, pieces = shard(full_state(seed), 0, 1)
    return save_shards(save_dir, tag, group=None, tensors=tensors, pieces=pieces, meta=meta())


@pytest.fixture
def two_tags(tmp_path):
    save_dir = tmp_path / "ckpt"
    _save(save_dir, "t1", 1)
    _save(save_dir, "t2", 2)
    return save_dir


def _flip(path, pos):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_carries_its_own_checksum_and_a_record_per_tensor(two_tags):
    raw = (two_tags / "t2" / "manifest.json").read_bytes()
    assert checksums.unseal(raw, "m", CheckpointError, "fix") is True
    entry = json.loads(raw)["ranks"][0]
    assert "sha256" not in entry
    rec = entry["checksum"]
    assert rec["algo"] == "xxh3_64" and rec["size"] == entry["size"]
    assert set(rec["tensors"]) == {"param.flat", "exp_avg.flat", "rng.torch"}


def test_a_flipped_digit_in_the_manifest_is_named(two_tags):
    m = two_tags / "t2" / "manifest.json"
    text = m.read_text()
    pos = text.index('"step": 7') + len('"step": ')  # valid JSON either way: 7 -> 6
    _flip(m, pos)
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(two_tags)  # latest = t2
    msg = str(e.value)
    assert msg.startswith(f"{m}: the file is corrupted: its bytes 0..")
    assert "load the previous checkpoint (tag='t1')" in msg and "MESHTRAIN_VERIFY=0" in msg
    assert CheckpointReader(two_tags, verify=False).meta["step"] == 6  # inspect anyway


def test_damaged_tensor_named_only_when_read_and_inspect_anyway(two_tags, monkeypatch):
    f = two_tags / "t2" / "rank00000.safetensors"
    _flip(f, f.stat().st_size - 1)  # the last byte: inside the last tensor's data
    r = CheckpointReader(two_tags, "t2")  # the header is intact: opening succeeds
    with pytest.raises(CheckpointError) as e:
        for name in r.names():
            r.read(name)
        r.rank_tensor(0, "rng.torch")
    assert "is corrupted: its xxh3_64 checksum differs" in str(e.value)
    assert f"{f}: tensor '" in str(e.value) and "(rank 0) load the previous" in str(e.value)
    monkeypatch.setenv("MESHTRAIN_VERIFY", "0")
    r = CheckpointReader(two_tags, "t2")
    for name in r.names():
        r.read(name)  # loads, damaged bytes and all, for inspection


def test_undamaged_reads_are_identical_with_and_without_verification(two_tags):
    with CheckpointReader(two_tags, "t2") as a, CheckpointReader(two_tags, "t2", verify=False) as b:
        for state in a.states():
            for name in a.names(state):
                assert torch.equal(a.read(name, state), b.read(name, state))
                assert torch.equal(a.read(name, state, 1, 0), b.read(name, state, 1, 0))
        assert torch.equal(a.rank_tensor(0, "rng.torch"), b.rank_tensor(0, "rng.torch"))


def test_older_sha256_manifest_still_verifies(two_tags):
    import hashlib

    m = two_tags / "t2" / "manifest.json"
    data = json.loads(m.read_text())
    data.pop("_checksum")
    data["format_version"] = 1  # the last version with whole-file sha256 records
    data.pop("meshtrain_version")
    f = two_tags / "t2" / "rank00000.safetensors"
    entry = data["ranks"][0]
    entry.pop("checksum")
    entry["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    m.write_text(json.dumps(data))  # as written before issue 32: no seal, whole-file sha256
    full = CheckpointReader(two_tags, "t2").read_full("layer.w")
    assert full.shape == (5, 3)
    _flip(f, f.stat().st_size - 1)
    with pytest.raises(
        CheckpointError, match=r"rank00000\.safetensors \(rank 0\) is corrupted: its sha256"
    ):
        CheckpointReader(two_tags, "t2").read_full("layer.w")


def test_export_checksums_verified_and_named(two_tags, tmp_path):
    out = consolidate(two_tags, tmp_path / "export", tag="t2")
    assert verify_export(out, CheckpointError) is True
    assert check_folder(out, CheckpointError) == "checksums verified"
    single = consolidate(two_tags, tmp_path / "one.safetensors", tag="t2")
    assert (tmp_path / "one.safetensors.checksums.json").is_file()
    assert verify_export(single, CheckpointError) is True
    _flip(single, single.stat().st_size - 2)
    with pytest.raises(CheckpointError, match=r"one\.safetensors: tensor '.*' \(bytes \d+\.\.\d+"):
        verify_export(single, CheckpointError)
    _flip(out / "model.safetensors", 20)  # inside the header
    with pytest.raises(
        ServeError, match=r"model\.safetensors: the safetensors header .* corrupted"
    ):
        check_folder(out, ServeError)


def test_foreign_folder_header_sizes_and_dtypes(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"})
    )
    good = {"a.weight": torch.zeros(4, 2, dtype=torch.bfloat16), "norm": torch.ones(3)}
    save_file(good, folder / "model.safetensors")
    assert "header, sizes and dtypes checked" in check_folder(folder, ServeError)
    save_file({"a.weight": torch.zeros(4, 2, dtype=torch.float16)}, folder / "model.safetensors")
    with pytest.raises(
        ServeError, match=r"tensor 'a\.weight' is float16, but config\.json declares dtype bfloat16"
    ):
        check_folder(folder, ServeError)
    save_file(good, folder / "model.safetensors")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(
        ServeError, match=r"is damaged \(truncated or not a safetensors file: .* cut short\)"
    ):
        check_folder(folder, ServeError)
    f.unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(
        ServeError, match=r"weight_map names 'model-00001-of-00002\.safetensors', which is not in"
    ):
        check_folder(folder, ServeError)
    (folder / "config.json").write_text('{"model_type": "llama", "model_type": "bert"}')
    with pytest.raises(
        ServeError,
        match=r"config\.json: duplicate key 'model_type' at line 1, column 25 \(first at line 1, column 2\)",
    ):
        check_folder(folder, ServeError)


def _key_span(path, key):
    from meshtrain.checkpoint.rank_file import RankFile

    rf = RankFile(path, 0, record=None, sha256=None, verify=False, fix="")
    try:
        return rf.keys[key][2:]
    finally:
        rf.close()


def test_part_of_a_key_is_hashed_in_place_then_sliced_from_the_same_pages(two_tags, monkeypatch):
    """A range of a key: the whole key is hashed once, in windows (8 bytes here, so many),
    in place in the page cache (never read into memory of its own), later slices are not
    hashed again, the slices are views of safetensors' map of the file, damage outside the
    range is caught, and a file truncated after it was opened is named as such."""
    from meshtrain.checkpoint import rank_file

    monkeypatch.setattr(rank_file.checksums, "WINDOW", 8)
    fed, passes = [], []
    real_hasher = checksums.hasher

    def counting_hasher():
        h = real_hasher()
        return type("H", (), {"update": lambda _s, b: fed.append(len(b)) or h.update(b),
                              "hexdigest": lambda _s: h.hexdigest()})()  # fmt: skip

    monkeypatch.setattr(rank_file.checksums, "hasher", counting_hasher)
    orig_pass = rank_file.RankFile._pass
    monkeypatch.setattr(
        rank_file.RankFile,
        "_pass",
        lambda self, key, *a, **k: passes.append(key) or orig_pass(self, key, *a, **k),
    )
    f = two_tags / "t2" / "rank00000.safetensors"
    begin, end = _key_span(f, "param.flat")
    with CheckpointReader(two_tags, "t2", verify=False) as b:
        want = {n: b.read(n) for n in b.names()}
    with CheckpointReader(two_tags, "t2") as a:
        for name, w in want.items():
            assert torch.equal(a.read(name), w)
        rf = a._files[0]
        assert "param.flat" in rf.verified
        mapped = rf.mapped().get_slice("param.flat")[:].untyped_storage().data_ptr()
        part = a._slice(0, "param.flat", 1, 3)
        assert part.untyped_storage().data_ptr() == mapped  # a view of the mapped file
    assert "param.flat" not in passes  # never read into memory of its own
    n = end - begin
    assert sum(fed) == n  # param.flat (the only key read), once for several slices
    assert len(fed) == -(-n // 8)  # in 8-byte windows
    _flip(f, end - 1)  # the last element of param.flat: not part of layer.w
    with CheckpointReader(two_tags, "t2") as a, pytest.raises(CheckpointError) as e:
        a.read("layer.w")
    assert f"{f}: tensor 'param.flat'" in str(e.value) and "is corrupted" in str(e.value)
    with CheckpointReader(two_tags, "t1") as a:
        g = two_tags / "t1" / "rank00000.safetensors"
        a._open(0)  # sizes checked and the header read; then the file shrinks
        with open(g, "r+b") as fh:
            fh.truncate(_key_span(g, "param.flat")[0] + 4)
        with pytest.raises(CheckpointError, match="truncated after it was opened"):
            a.read("layer.w")


@pytest.mark.parametrize("parts", [True, False])
def test_verifying_part_of_a_large_key_keeps_no_copy_resident(tmp_path, monkeypatch, parts):
    """Checking a 48 MiB key to read 16 of its elements: the process's peak resident
    memory (anonymous and file pages) grows by far less than the key. With part digests
    (the default for keys over 4 MiB) only the 4 MiB part holding the range is hashed;
    without (a record written before them) the whole key is hashed in place, in windows
    (``checksums.WINDOW`` forced to 4 MiB here) whose pages leave the map once hashed.
    Reading the key into memory first (the reader before) grew it by the key's 48 MiB,
    and so does mapping it whole."""
    from meshtrain.checkpoint import Piece, rank_file, tensor_files

    monkeypatch.setattr(rank_file.checksums, "WINDOW", 4 << 20)
    if not parts:
        monkeypatch.setattr(tensor_files, "PART_BYTES", 1 << 40)
    n = 12 << 20  # 48 MiB of fp32
    big = torch.arange(n, dtype=torch.float32)
    pieces = [Piece("w", "param", "param.flat", 0, 0, n)]
    m = {"tensors": {"w": {"shape": [n], "dtype": "float32", "kind": "param"}}, "step": 1}
    save_shards(tmp_path, "t", group=None, tensors={"param.flat": big}, pieces=pieces, meta=m)
    del big

    def peak() -> int:  # VmHWM: the highest resident memory (anonymous and file pages)
        fields = dict(
            line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
        )
        return int(fields["VmHWM"].split()[0]) * 1024

    with CheckpointReader(tmp_path, "t") as r:
        rf = r._open(0)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak to what is resident now
        before = peak()
        part = r.read("w", "param", n - 16, 16)
        grew = peak() - before
        assert torch.equal(part, torch.arange(n - 16, n, dtype=torch.float32))
        if parts:
            assert rf._parts_ok["param.flat"] == {11} and "param.flat" not in rf.verified
        else:
            assert "param.flat" in rf.verified
    assert grew < 8 << 20, f"peak resident memory grew {grew / 2**20:.1f} MiB for a 48 MiB key"


def test_a_read_checks_only_the_parts_it_reads(two_tags, monkeypatch, tmp_path):
    """With part digests (16-byte parts here), a range is checked by the parts it lies in,
    hashed in place: damage in another part of the same key is found when that part is
    read, or by ``verify_all``, not by a read that never touches it. Every part read once
    makes the key verified; a record with a malformed parts table is refused by name."""
    from meshtrain.checkpoint import rank_file, tensor_files

    monkeypatch.setattr(tensor_files, "PART_BYTES", 16)
    save_dir = tmp_path / "ckpt"
    _save(save_dir, "t", 3)
    f = save_dir / "t" / "rank00000.safetensors"
    rec = json.loads((save_dir / "t" / "manifest.json").read_text())["ranks"][0]["checksum"]
    begin, end = _key_span(f, "param.flat")
    assert rec["parts"]["bytes"] == 16
    assert len(rec["parts"]["tensors"]["param.flat"]) == -(-(end - begin) // 16)
    hashed, whole = [], []
    orig = rank_file.checksums.digest
    monkeypatch.setattr(rank_file.checksums, "digest", lambda d: hashed.append(len(d)) or orig(d))
    monkeypatch.setattr(rank_file.RankFile, "verify_key", lambda self, k: whole.append(k))
    _flip(f, end - 1)  # the last element of param.flat: the last part, not layer.w's
    with CheckpointReader(save_dir, "t") as r:
        r.read("layer.w")  # elements 66..81 of param.flat (embed.weight's 66 come first)
        parts = [n for n in hashed if n <= 16]  # the header's digest is longer
        assert parts == [16] * (-(-(81 * 4) // 16) - (66 * 4) // 16) and not whole
        with pytest.raises(CheckpointError) as e:
            r.read("temperature")  # the last element: in the damaged part
        msg = str(e.value)
        assert f"{f}: tensor 'param.flat' (part " in msg and "is corrupted" in msg
    monkeypatch.undo()  # the real whole-key check for verify_all
    with CheckpointReader(save_dir, "t") as r, pytest.raises(CheckpointError, match="corrupted"):
        r.verify_all()
    _flip(f, end - 1)  # undamaged again: every part read makes the key verified
    with CheckpointReader(save_dir, "t") as r:
        for name in r.names():
            r.read(name)
        assert "param.flat" in r._files[0].verified
    m = save_dir / "t" / "manifest.json"
    data = json.loads(m.read_text())
    data.pop("_checksum")
    data["ranks"][0]["checksum"]["parts"]["tensors"]["param.flat"].pop()
    m.write_text(checksums.seal(json.dumps(data, indent=1)))
    with CheckpointReader(save_dir, "t") as r, pytest.raises(CheckpointError) as e:
        r.read("layer.w")
    assert f"{f}: the manifest's per-part checksums of this file are malformed" in str(e.value)
