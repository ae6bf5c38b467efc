"""prepare(): input formats, bad rows, reuse by content hash, packing, dtypes, the CLI."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from meshtrain.data import ByteTokenizer, TokenDataset, TokenStore, load_tokenizer, prepare
from meshtrain.data.tokenizer import HFTokenizer, as_tokenizer, token_dtype
from meshtrain.errors import DataError

EOS = 258


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


def docs(out) -> list[list[int]]:
    store = TokenStore(out)
    return [store.doc(i).tolist() for i in range(len(store))]


def texts(out) -> list[str]:
    return [ByteTokenizer().decode(d) for d in docs(out)]


class ExplodingTokenizer(ByteTokenizer):
    """Same fingerprint as the byte tokenizer, but tokenizing raises: proves reuse."""

    def encode_to_arrays(self, *args, **kwargs):
        raise AssertionError("prepare tokenized although the store was up to date")

    encode_batch = encode_to_arrays


def test_jsonl_workers_and_chunks_do_not_change_the_store(tmp_path):
    rows = [{"text": f"doc {i} é", "label": i % 3} for i in range(500)]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    one = prepare(src, "byte", tmp_path / "one", workers=1, label_field="label")
    two = prepare(src, "byte", tmp_path / "two", workers=2, label_field="label", chunk_bytes=300)
    for name in ("tokens.bin", "offsets.bin", "labels.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert one.docs == two.docs == 500 and one.rows_read == 500
    ds = TokenDataset(tmp_path / "two")
    assert ds[7]["input_ids"].tolist() == [257, *b"doc 7 \xc3\xa9", EOS] and ds[7]["labels"] == 1
    assert ds[-1]["labels"] == 499 % 3
    assert json.loads((tmp_path / "two" / "meta.json").read_text())["dtype"] == "uint16"


def test_second_prepare_does_no_tokenizing(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}, {"text": "world"}])
    first = prepare(src, "byte", tmp_path / "s", workers=1)
    stamp = os.stat(tmp_path / "s" / "tokens.bin").st_mtime_ns
    again = prepare(src, ExplodingTokenizer(), tmp_path / "s", workers=1)
    assert again.reused and not first.reused
    assert os.stat(tmp_path / "s" / "tokens.bin").st_mtime_ns == stamp
    assert "nothing tokenized" in again.summary()
    write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}, {"text": "changed"}])
    rebuilt = prepare(src, "byte", tmp_path / "s", workers=1)
    assert not rebuilt.reused and texts(tmp_path / "s") == ["hello", "changed"]
    assert prepare(src, "byte", tmp_path / "s", workers=1, force=True).reused is False
    write_jsonl(tmp_path / "a.jsonl", [{"text": "new"}, "{broken"])
    with pytest.raises(DataError, match="a.jsonl:2"):
        prepare(src, "byte", tmp_path / "s", workers=1)
    assert texts(tmp_path / "s") == ["hello", "changed"], "a failed run leaves the old store"


def test_empty_text_is_skipped_and_a_missing_field_is_reported(tmp_path):
    """Blank or null text is skipped and counted; an object without the text field is a
    bad row naming file:line (issue 18: it used to be counted as "empty" silently)."""
    src = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"text": "a"},
            {"text": ""},
            {"text": None},
            {"review": "x"},
            "",
            {"text": "  "},
            {"text": "b"},
        ],
    )
    with pytest.raises(DataError, match=r"a.jsonl:4: no field 'text' .*'review'.*--text-field"):
        prepare(src, "byte", tmp_path / "s", workers=2, chunk_bytes=16)
    result = prepare(src, "byte", tmp_path / "s", workers=2, chunk_bytes=16, skip_bad_rows=True)
    assert (result.rows_read, result.skipped_empty, result.skipped_bad, result.docs) == (7, 4, 1, 2)
    assert texts(tmp_path / "s") == ["a", "b"]
    with pytest.raises(DataError, match=r"a.jsonl:1: no field 'body' .*--text-field"):
        prepare(src, "byte", tmp_path / "t", text_field="body")


def test_malformed_json_names_file_and_line(tmp_path):
    rows = [{"text": f"r{i}"} for i in range(40)]
    lines = [json.dumps(r) for r in rows]
    lines[24] = '{"text": "broken'
    lines[31] = "[1, 2]"
    src = write_jsonl(tmp_path / "bad.jsonl", lines)
    for workers in (1, 2):
        with pytest.raises(DataError, match=r"bad\.jsonl:25: malformed JSON.*--skip-bad-rows"):
            prepare(src, "byte", tmp_path / "s", workers=workers, chunk_bytes=64)
    assert not (tmp_path / "s").exists() or not (tmp_path / "s" / "meta.json").exists()
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "s").iterdir())
    result = prepare(src, "byte", tmp_path / "s", workers=2, chunk_bytes=64, skip_bad_rows=True)
    assert (result.rows_read, result.skipped_bad, result.docs) == (40, 2, 38)
    assert "bad.jsonl:25: malformed JSON (Unterminated string" in result.bad_rows[0]
    assert "bad.jsonl:32: expected a JSON object, got list" in result.bad_rows[1]


def test_non_string_text_and_bad_label_are_bad_rows(tmp_path):
    src = write_jsonl(
        tmp_path / "a.jsonl",
        [{"text": "ok", "y": 1}, {"text": 5, "y": 1}, {"text": "ok", "y": "pos"}],
    )
    with pytest.raises(DataError, match=r"a\.jsonl:2: field 'text' is int"):
        prepare(src, "byte", tmp_path / "s", label_field="y")
    result = prepare(src, "byte", tmp_path / "s", label_field="y", skip_bad_rows=True)
    assert (
        result.skipped_bad == 2
        and "a.jsonl:3: field 'y': label 'pos' is not an integer" in result.bad_rows[1]
    )


def test_csv_tsv_text_gzip_and_json_array(tmp_path):
    (tmp_path / "a.csv").write_text(
        'id,review,label\n1,"good, very\ngood",1\n2,,0\n3,bad,0\n', encoding="utf-8"
    )
    (tmp_path / "b.tsv").write_text("review\nfine\n", encoding="utf-8")
    (tmp_path / "c.txt").write_text("line one\n\nline two\n", encoding="utf-8")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"review": "zipped"}\n')
    (tmp_path / "e.json").write_text(
        json.dumps([{"review": "arr"}, {"review": None}]), encoding="utf-8"
    )
    inputs = [tmp_path / n for n in ("a.csv", "b.tsv", "c.txt", "d.jsonl.gz", "e.json")]
    result = prepare(inputs, "byte", tmp_path / "s", text_field="review", workers=2)
    assert texts(tmp_path / "s") == [
        "good, very\ngood",
        "bad",
        "fine",
        "line one",
        "line two",
        "zipped",
        "arr",
    ]
    assert (result.rows_read, result.skipped_empty) == (3 + 1 + 3 + 1 + 2, 3)


def test_malformed_csv(tmp_path):
    (tmp_path / "a.csv").write_text('text,label\nok,1\n"bad"x,0\na,b,c\nfine,1\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"a\.csv:3: malformed CSV"):
        prepare(tmp_path / "a.csv", "byte", tmp_path / "s")
    result = prepare(
        tmp_path / "a.csv", "byte", tmp_path / "s", skip_bad_rows=True, label_field="label"
    )
    assert (
        result.skipped_bad == 2
        and "a.csv:4: malformed CSV (expected 2 fields, got 3)" in result.bad_rows[1]
    )
    assert texts(tmp_path / "s") == ["ok", "fine"]
    with pytest.raises(DataError, match=r"a\.csv:1: no column 'body'.*--text-field"):
        prepare(tmp_path / "a.csv", "byte", tmp_path / "t", text_field="body", skip_bad_rows=True)


def test_datasets_dataset_input(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["x", None, "yz"], "label": [1, 0, 2]})
    result = prepare(ds, "byte", tmp_path / "s", label_field="label")
    assert (result.rows_read, result.skipped_empty, result.docs) == (3, 1, 2)
    assert [d["labels"] for d in TokenDataset(tmp_path / "s")] == [1, 2]
    assert prepare(ds, "byte", tmp_path / "s", label_field="label").reused


def test_packing_and_truncation(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "ab"}, {"text": "c"}, {"text": "defg"}])
    prepare(src, "byte", tmp_path / "p", seq_len=3, pack=True)
    # a b <eos> c <eos> d e f g <eos>  -> rows of 3, the last token is left over
    ds = TokenDataset(tmp_path / "p")
    assert len(ds) == 3
    assert [ds[i]["input_ids"].tolist() for i in range(3)] == [
        [97, 98, EOS],
        [99, EOS, 100],
        [101, 102, 103],
    ]
    prepare(
        src, "byte", tmp_path / "t", seq_len=4
    )  # no packing: truncate, specials kept at the front
    assert docs(tmp_path / "t") == [[257, 97, 98, EOS], [257, 99, EOS], [257, 100, 101, 102]]
    assert TokenDataset(tmp_path / "t", max_length=2)[0]["input_ids"].tolist() == [257, 97]
    with pytest.raises(DataError, match="--pack needs --seq-len"):
        prepare(src, "byte", tmp_path / "x", pack=True)


class BigVocab(ByteTokenizer):
    vocab_size = 70_000

    def fingerprint(self) -> str:
        return "big"

    def encode_to_arrays(self, texts, add_special_tokens, append_eos):
        flat, lengths = super().encode_to_arrays(texts, add_special_tokens, append_eos)
        return flat.astype(np.int64) + 69_000, lengths


def test_dtype_follows_vocabulary_size(tmp_path):
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    prepare(src, BigVocab(), tmp_path / "s", workers=1, add_special_tokens=False)
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["dtype"] == "uint32"
    assert docs(tmp_path / "s") == [[69_097]]


def _train_hf_tokenizer(folder) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world", "good morning world", "hello there"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[PAD]", "[UNK]", "</s>"]))  # fmt: skip
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    return str(folder)


def test_hf_tokenizer_by_path_in_workers(tmp_path):
    pytest.importorskip("transformers")
    path = _train_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(path)
    assert (
        isinstance(tok, HFTokenizer)
        and pickle.loads(pickle.dumps(tok)).fingerprint() == tok.fingerprint()
    )
    assert len(pickle.dumps(tok)) < 200, "pickles as its path, loaded again in each worker"
    rows = [{"text": t} for t in ("hello world", "good morning", "there world hello")] * 50
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    prepare(src, path, tmp_path / "s", workers=2, chunk_bytes=256, seq_len=8, pack=True)
    expected = [i for r in rows for i in tok.encode(r["text"]) + [tok.eos_id]]
    assert TokenStore(tmp_path / "s").tokens.tolist() == expected
    assert as_tokenizer(tok.tok).fingerprint() == tok.fingerprint()
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))


def test_dataset_pickles_without_data(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * 1000}] * 100)
    prepare(src, "byte", tmp_path / "s")
    ds = TokenDataset(tmp_path / "s")
    _ = ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 1000
    assert torch.equal(pickle.loads(blob)[3]["input_ids"], ds[3]["input_ids"])
    (tmp_path / "s" / "offsets.bin").write_bytes(b"")
    with pytest.raises(DataError, match="incomplete, run prepare again"):
        TokenStore(tmp_path / "s")


def test_cli(tmp_path, capsys):
    from meshtrain.cli import main

    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}, "{oops", {"text": "b"}])
    out = str(tmp_path / "s")
    assert main(["data", "prepare", src, "--tokenizer", "byte", "--out", out, "--no-progress"]) == 1
    assert "a.jsonl:2: malformed JSON" in capsys.readouterr().err
    argv = [
        "data",
        "prepare",
        src,
        "--tokenizer",
        "byte",
        "--out",
        out,
        "--skip-bad-rows",
        "--workers",
        "2",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "3 rows read, 0 skipped empty, 1 skipped bad, 2 documents" in captured.out
    assert "tokens/s" in captured.out
    assert main(["data", "info", out]) == 0 and '"num_docs": 2' in capsys.readouterr().out


def test_import_is_light():
    code = (
        "import sys, meshtrain, meshtrain.data\n"
        "from meshtrain.data import prepare, DistributedSampler, TokenDataset, ChatCollator\n"
        "bad = [m for m in ('transformers', 'datasets', 'tokenizers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spawned_workers(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"t{i}"} for i in range(300)])
    result = prepare(src, "byte", tmp_path / "s", workers=2, chunk_bytes=512, start_method="spawn")
    assert result.docs == 300 and texts(tmp_path / "s")[299] == "t299"


def test_token_dataset_through_loader_workers(tmp_path):
    from meshtrain.data import CausalLMCollator, ResumableDataLoader

    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * (i % 7 + 1)} for i in range(64)])
    prepare(src, "byte", tmp_path / "s", add_special_tokens=False)
    ds = TokenDataset(tmp_path / "s")
    loader = ResumableDataLoader(
        ds,
        8,
        num_replicas=2,
        rank=1,
        seed=3,
        num_workers=2,
        collate_fn=CausalLMCollator(ByteTokenizer()),
    )
    lengths = []
    for batch in loader:
        assert batch["input_ids"].shape[0] == 8
        assert ((batch["labels"] == 120) == (batch["attention_mask"] == 1)).all()
        lengths.extend(batch["attention_mask"].sum(1).tolist())
    expected = [len(ds[i]["input_ids"]) for i in loader.sampler.indices(0)]
    assert lengths == expected and loader.state_dict()["consumed"] == 64
