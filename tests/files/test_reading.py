"""The one reading path (meshtrain.files): encodings, duplicate keys, empty and truncated
files, each refused in one line naming file, line, column and fix. Real files throughout."""

from __future__ import annotations

import codecs

import pytest

from meshtrain.config.loading import read_config_file
from meshtrain.errors import ConfigError, DataError
from meshtrain.files.structured import json_row, load_json, parse_yaml
from meshtrain.files.text import read_text
from meshtrain.launch.hostfile import parse_hostfile


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_utf8_bom_and_utf16_with_bom_are_read(tmp_path):
    f = tmp_path / "c.json"
    f.write_bytes(codecs.BOM_UTF8 + b'{"train_batch_size": 8}')
    assert read_config_file(f) == {"train_batch_size": 8}
    f.write_bytes('{"train_batch_size": 4}'.encode("utf-16"))  # with its BOM
    assert read_config_file(f) == {"train_batch_size": 4}
    h = tmp_path / "hosts"
    h.write_bytes(codecs.BOM_UTF8 + b"worker-1 slots=2\n")
    assert parse_hostfile(h) == {"worker-1": 2}


def test_utf16_without_bom_and_latin1_are_named(tmp_path):
    f = tmp_path / "c.json"
    f.write_bytes('{"a": 1}'.encode("utf-16-le"))
    with pytest.raises(ConfigError, match=r"c\.json: .*UTF-16LE without a byte-order mark; "
                       r"re-save it as UTF-8 \(e\.g\. `iconv"):  # fmt: skip
        read_config_file(f)
    f.write_bytes('{\n  "name": "caf\u00e9"\n}'.encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        read_config_file(f)
    assert "c.json: byte 0xe9 at line 2, column 15 is not valid UTF-8" in _one_line(e.value)
    assert "re-save it as UTF-8" in str(e.value)


def test_binary_file_is_named(tmp_path):
    f = tmp_path / "hosts"
    f.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00")
    with pytest.raises(ConfigError, match=r"hosts: a NUL byte at line 1, column 8: this is a "
                       r"binary file"):  # fmt: skip
        parse_hostfile(f)


def test_empty_and_whitespace_files_are_named(tmp_path):
    f = tmp_path / "x.json"
    f.write_bytes(b"")
    with pytest.raises(DataError, match=r"x\.json: the JSON file is empty \(0 bytes\)"):
        load_json(f, DataError)
    f.write_bytes(b"  \n")
    with pytest.raises(DataError, match=r"x\.json: the JSON file holds only whitespace"):
        load_json(f, DataError)
    h = tmp_path / "hosts"
    h.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"hosts: the hostfile is empty \(0 bytes\).*slots=N"):
        parse_hostfile(h)


def test_truncated_json_is_named_as_such(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{\n  "train_batch_size": 8,\n  "optimizer": {"type": "Adam"')
    with pytest.raises(ConfigError) as e:
        read_config_file(f)
    msg = _one_line(e.value)
    assert "c.json: the JSON ends early (the file is truncated or incomplete) at line 3" in msg
    f.write_text('{"a": "unterminated')
    with pytest.raises(ConfigError, match="ends early"):
        read_config_file(f)


def test_duplicate_keys_refused_with_both_positions(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{\n  "lr": 0.001,\n  "opt": {"lr": 1, "b": {"lr": 2}},\n  "lr": 1\n}')
    with pytest.raises(ConfigError) as e:
        read_config_file(f)
    assert _one_line(e.value).startswith(
        f"{f}: duplicate key 'lr' at line 4, column 3 (first at line 2, column 3)"
    )
    y = tmp_path / "c.yaml"
    y.write_text("train_batch_size: 8\nzero_optimization:\n  stage: 2\n  stage: 3\n")
    with pytest.raises(ConfigError) as e:
        read_config_file(y)
    assert "c.yaml: duplicate key 'stage' at line 4, column 3 (first at line 3, column 3)" in (
        _one_line(e.value)
    )
    # the same key in different objects is not a duplicate
    f.write_text('{"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 3}, {"x": 4}]}')
    assert read_config_file(f)["c"] == [{"x": 3}, {"x": 4}]


def test_json_row_reasons():
    assert json_row('{"text": "a"}') == ({"text": "a"}, None)
    obj, why = json_row('{"text": "a", "label": 1, "text": "b"}')
    assert obj is None and why.startswith("duplicate key 'text' at column 27 (first at column 2)")
    assert json_row('{"text": ')[1].startswith("malformed JSON")


def test_yaml_errors_name_line_and_column(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"y: invalid YAML at line 3, column 2: expected .,. or .\]., .*; fix the file",
    ):
        parse_yaml("a: 1\nb: [1, 2\nc: 3\n", "y", ConfigError)


def test_read_text_missing_and_folder(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt: no such file; check the path"):
        read_text(tmp_path / "nope.txt", DataError)
    with pytest.raises(DataError, match="is a folder, not a file"):
        read_text(tmp_path, DataError)
