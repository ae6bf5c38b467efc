"""Token store checksums and the data readers' encodings and duplicates (issue 32), on real
files: damage named at load, a damaged store rebuilt instead of reused, BOMs read,
UTF-16 and duplicate keys/columns refused with positions."""

from __future__ import annotations

import codecs
import json
import logging

import pytest

from meshtrain.data import prepare
from meshtrain.data.store import TokenDataset, TokenStore
from meshtrain.errors import DataError
from meshtrain.files import checksums


def _rows(n=50):
    return "".join(json.dumps({"text": f"document {i} " + "xy" * i}) + "\n" for i in range(n))


@pytest.fixture
def store(tmp_path):
    (tmp_path / "in.jsonl").write_text(_rows())
    prepare(tmp_path / "in.jsonl", "byte", tmp_path / "s", workers=1)
    return tmp_path / "s"


def test_meta_is_sealed_and_records_every_file(store):
    raw = (store / "meta.json").read_bytes()
    assert checksums.unseal(raw, "m", DataError, "fix") is True
    sums = json.loads(raw)["checksums"]
    assert sums["algo"] == "xxh3_64"
    assert sums["tokens.bin"] == checksums.digest_file(store / "tokens.bin")
    assert sums["offsets.bin"] == checksums.digest_file(store / "offsets.bin")


def test_damaged_store_is_named_at_load_and_inspectable(store, monkeypatch):
    before = TokenStore(store).tokens.copy()
    tokens = store / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[100] ^= 0x20
    tokens.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        TokenStore(store)
    msg = str(e.value)
    assert msg.startswith(f"{tokens}: the token store file is corrupted in bytes 0..{len(data)}")
    assert "--force" in msg and "MESHTRAIN_VERIFY=0" in msg
    with pytest.raises(DataError, match="tokens.bin: the token store file is corrupted"):
        TokenDataset(store)
    monkeypatch.setenv("MESHTRAIN_VERIFY", "0")
    after = TokenStore(store).tokens  # opened anyway: the damage is there to inspect
    assert (after != before).sum() == 1 and after[50] != before[50]  # uint16 token 50


def test_prepare_rebuilds_a_damaged_store_instead_of_reusing_it(store, tmp_path, caplog):
    first = TokenStore(store).tokens.copy()
    offsets = store / "offsets.bin"
    data = bytearray(offsets.read_bytes())
    data[9] ^= 0x01
    offsets.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="meshtrain.data"):
        result = prepare(tmp_path / "in.jsonl", "byte", store, workers=1)
    assert not result.reused
    assert "not reusing the token store" in caplog.text and "offsets.bin" in caplog.text
    assert (TokenStore(store).tokens == first).all()
    assert prepare(tmp_path / "in.jsonl", "byte", store, workers=1).reused  # intact: reused


def test_bom_jsonl_and_csv_are_read(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(codecs.BOM_UTF8 + _rows(3).encode())
    (tmp_path / "b.csv").write_bytes(codecs.BOM_UTF8 + b"text,label\nhello,1\nworld,0\n")
    r = prepare([tmp_path / "a.jsonl", tmp_path / "b.csv"], "byte", tmp_path / "s", workers=1)
    assert r.docs == 5 and r.skipped_bad == 0


def test_utf16_data_file_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_rows(3).encode("utf-16"))
    with pytest.raises(DataError, match=r"a\.jsonl: the data file is UTF-16 .*re-save it as UTF-8"):
        prepare(tmp_path / "a.jsonl", "byte", tmp_path / "s", workers=1)


def test_duplicate_key_in_a_row_and_duplicate_csv_column(tmp_path):
    (tmp_path / "a.jsonl").write_text(_rows(2) + '{"text": "a", "text": "b"}\n')
    with pytest.raises(DataError) as e:
        prepare(tmp_path / "a.jsonl", "byte", tmp_path / "s", workers=1)
    assert "a.jsonl:3: duplicate key 'text' at column 15 (first at column 2)" in str(e.value)
    (tmp_path / "b.csv").write_text("text,label,text\na,1,b\n")
    with pytest.raises(DataError, match=r"b\.csv:1: column 'text' appears twice in the header "
                       r"\(columns 1 and 3\); rename one of them"):  # fmt: skip
        prepare(tmp_path / "b.csv", "byte", tmp_path / "s2", workers=1)


def test_json_array_errors_name_line_and_column(tmp_path):
    (tmp_path / "a.json").write_text('[\n  {"text": "a"},\n  {"text": "b", "text": "c"}\n]')
    with pytest.raises(DataError, match=r"a\.json: duplicate key 'text' at line 3, column 17 "
                       r"\(first at line 3, column 4\)"):  # fmt: skip
        prepare(tmp_path / "a.json", "byte", tmp_path / "s", workers=1)
    (tmp_path / "a.json").write_text('[\n  {"text": "a"},\n  {"text": "b"')
    with pytest.raises(DataError, match=r"a\.json: the JSON ends early .* at line 3"):
        prepare(tmp_path / "a.json", "byte", tmp_path / "s", workers=1)


def test_unwritable_out_is_refused_before_tokenizing(tmp_path):
    (tmp_path / "a.jsonl").write_text(_rows(3))
    with pytest.raises(
        DataError, match=r"token store folder --out /proc/store: cannot write in /proc"
    ):
        prepare(tmp_path / "a.jsonl", "byte", "/proc/store", workers=1)
