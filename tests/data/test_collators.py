"""Every collator against hand-computed tensors.

The byte tokenizer makes the expected ids obvious: a byte is its own id, and
<pad>=256, <bos>=257, <eos>=258, <mask>=259.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.data import (
    ByteTokenizer,
    CausalLMCollator,
    MaskedLMCollator,
    PaddingCollator,
    Seq2SeqCollator,
    TokenClassificationCollator,
)
from meshtrain.errors import DataError

PAD, BOS, EOS, MASK = 256, 257, 258, 259
X = -100


def T(rows):
    return torch.tensor(rows)


def test_padding_to_longest_and_multiple():
    feats = [
        {"input_ids": [1, 2, 3], "label": 1, "id": "a"},
        {"input_ids": [4], "label": 0, "id": "b"},
    ]
    batch = PaddingCollator(ByteTokenizer())(feats)
    assert torch.equal(batch["input_ids"], T([[1, 2, 3], [4, PAD, PAD]]))
    assert torch.equal(batch["attention_mask"], T([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(batch["labels"], T([1, 0]))
    assert batch["id"] == ["a", "b"]
    batch = PaddingCollator(pad_token_id=0, pad_to_multiple_of=4, padding_side="left")(
        [{"input_ids": torch.tensor([1, 2, 3]), "token_type_ids": [0, 1, 1], "score": 0.5},
         {"input_ids": torch.tensor([4]), "token_type_ids": [0], "score": 1.5}]
    )  # fmt: skip
    assert torch.equal(batch["input_ids"], T([[0, 1, 2, 3], [0, 0, 0, 4]]))
    assert torch.equal(batch["attention_mask"], T([[0, 1, 1, 1], [0, 0, 0, 1]]))
    assert torch.equal(batch["token_type_ids"], T([[0, 0, 1, 1], [0, 0, 0, 0]]))
    assert torch.equal(batch["score"], torch.tensor([0.5, 1.5]))
    with pytest.raises(DataError, match="pad_id"):
        PaddingCollator()


def test_causal_lm_labels_ignore_padding_not_eos():
    # pad id == eos id (a common choice): real EOS tokens keep their label
    feats = [{"input_ids": [1, 2, EOS]}, {"input_ids": [4, EOS]}]
    batch = CausalLMCollator(pad_token_id=EOS, pad_to_multiple_of=4)(feats)
    assert torch.equal(batch["input_ids"], T([[1, 2, EOS, EOS], [4, EOS, EOS, EOS]]))
    assert torch.equal(batch["attention_mask"], T([[1, 1, 1, 0], [1, 1, 0, 0]]))
    assert torch.equal(batch["labels"], T([[1, 2, EOS, X], [4, EOS, X, X]]))


def test_seq2seq_labels_padded_with_ignore_index():
    feats = [
        {"input_ids": [1, 2, 3], "labels": [7, 8]},
        {"input_ids": [4], "labels": [9, 10, 11, 12]},
    ]
    batch = Seq2SeqCollator(pad_token_id=0, decoder_start_token_id=0)(feats)
    assert torch.equal(batch["input_ids"], T([[1, 2, 3], [4, 0, 0]]))
    assert torch.equal(batch["attention_mask"], T([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(batch["labels"], T([[7, 8, X, X], [9, 10, 11, 12]]))
    assert torch.equal(batch["decoder_input_ids"], T([[0, 7, 8, 0], [0, 9, 10, 11]]))


MLM_FEATS = [{"input_ids": [BOS, 10, 11, EOS]}, {"input_ids": [BOS, 12, EOS]}]
MLM_LABELS = T([[X, 10, 11, X], [X, 12, X, X]])


def test_mlm_all_selected_all_masked():
    batch = MaskedLMCollator(
        ByteTokenizer(), mlm_probability=1.0, mask_replace_prob=1.0, random_replace_prob=0.0
    )(MLM_FEATS)
    assert torch.equal(batch["input_ids"], T([[BOS, MASK, MASK, EOS], [BOS, MASK, EOS, PAD]]))
    assert torch.equal(batch["labels"], MLM_LABELS)
    assert torch.equal(batch["attention_mask"], T([[1, 1, 1, 1], [1, 1, 1, 0]]))


def test_mlm_kept_random_and_none():
    kept = MaskedLMCollator(
        ByteTokenizer(), mlm_probability=1.0, mask_replace_prob=0.0, random_replace_prob=0.0
    )
    batch = kept(MLM_FEATS)
    assert torch.equal(batch["input_ids"], T([[BOS, 10, 11, EOS], [BOS, 12, EOS, PAD]]))
    assert torch.equal(batch["labels"], MLM_LABELS)
    rand = MaskedLMCollator(ByteTokenizer(), mlm_probability=1.0, mask_replace_prob=0.0, random_replace_prob=1.0,
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    batch = rand(MLM_FEATS * 50)
    ids = batch["input_ids"]
    assert torch.equal(batch["labels"], MLM_LABELS.repeat(50, 1))
    selected = batch["labels"] != X
    assert torch.equal(
        ids[~selected], T([[BOS, 10, 11, EOS], [BOS, 12, EOS, PAD]]).repeat(50, 1)[~selected]
    )
    assert ((ids[selected] >= 0) & (ids[selected] < 260)).all()
    assert (ids[selected] != batch["labels"][selected]).float().mean() > 0.9
    none = MaskedLMCollator(ByteTokenizer(), mlm_probability=0.0)(MLM_FEATS)
    assert (none["labels"] == X).all()


def test_mlm_rates_15_percent_80_10_10():
    feats = [{"input_ids": [BOS] + [10] * 400 + [EOS]} for _ in range(250)]  # 100k candidates
    coll = MaskedLMCollator(ByteTokenizer(), generator=torch.Generator().manual_seed(1))
    batch = coll(feats)
    ids, labels = batch["input_ids"], batch["labels"]
    selected = labels != X
    assert not selected[:, 0].any() and not selected[:, -1].any(), "specials never selected"
    assert abs(selected.float().mean().item() * 402 / 400 - 0.15) < 0.005
    chosen = ids[selected]
    masked = (chosen == MASK).float().mean().item()
    kept = (chosen == 10).float().mean().item()
    assert (
        abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(1 - masked - kept - 0.1) < 0.01
    )
    # special_tokens_mask, when given, decides what may be selected
    batch = MaskedLMCollator(
        ByteTokenizer(), mlm_probability=1.0, mask_replace_prob=1.0, random_replace_prob=0.0
    )([{"input_ids": [5, 6, 7], "special_tokens_mask": [1, 0, 1]}])
    assert torch.equal(batch["input_ids"], T([[5, MASK, 7]]))
    assert "special_tokens_mask" not in batch


def test_token_classification_byte_words():
    # words "ab", "c" -> <bos> a b ␠ c <eos>; word_ids None 0 0 1 1 None
    feats = [{"tokens": ["ab", "c"], "labels": [3, 5]}, {"tokens": ["d"], "labels": [1]}]
    batch = TokenClassificationCollator(ByteTokenizer())(feats)
    assert torch.equal(
        batch["input_ids"], T([[BOS, 97, 98, 32, 99, EOS], [BOS, 100, EOS, PAD, PAD, PAD]])
    )
    assert torch.equal(batch["labels"], T([[X, 3, X, 5, X, X], [X, 1, X, X, X, X]]))
    batch = TokenClassificationCollator(
        ByteTokenizer(), label_all_tokens=True, subtoken_label_map={3: 4}
    )(feats)
    assert torch.equal(batch["labels"], T([[X, 3, 4, 5, 5, X], [X, 1, X, X, X, X]]))


def test_token_classification_seed_example():
    """The seeds' CoNLL example: 'lamb' splits into two sub-tokens (word 7)."""
    word_ids = [None, 0, 1, 2, 3, 4, 5, 6, 7, 7, 8, None]
    word_labels = [3, 0, 7, 0, 0, 0, 7, 0, 0]
    feats = [
        {"input_ids": list(range(100, 112)), "word_ids": word_ids, "labels": word_labels},
        {"input_ids": [101, 7, 8, 102], "labels": [X, 1, 2, X]},  # already aligned
    ]
    b_to_i = {1: 2, 3: 4, 5: 6, 7: 8}
    coll = TokenClassificationCollator(
        ByteTokenizer(), label_all_tokens=True, subtoken_label_map=b_to_i
    )
    batch = coll(feats)
    assert torch.equal(
        batch["labels"], T([[X, 3, 0, 7, 0, 0, 0, 7, 0, 0, 0, X], [X, 1, 2, X] + [X] * 8])
    )
    first_only = TokenClassificationCollator(ByteTokenizer())(feats[:1])
    assert torch.equal(first_only["labels"], T([[X, 3, 0, 7, 0, 0, 0, 7, 0, X, 0, X]]))
    assert batch["input_ids"].shape == (2, 12) and batch["attention_mask"][1].sum() == 4


def test_token_classification_truncation_and_errors():
    coll = TokenClassificationCollator(ByteTokenizer(), max_length=4)
    batch = coll([{"tokens": ["ab", "c"], "labels": [3, 5]}])
    assert torch.equal(batch["input_ids"], T([[BOS, 97, 98, EOS]]))
    assert torch.equal(batch["labels"], T([[X, 3, X, X]]))
    with pytest.raises(DataError, match="do not match"):
        coll([{"input_ids": [1, 2, 3], "labels": [1]}])


def test_token_classification_hf_wordpiece(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        ["the lamb", "a lamp", "the lab"] * 20,
        trainers.WordPieceTrainer(vocab_size=40, special_tokens=specials),
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    enc = tok.encode(["the", "lamb"], is_pretokenized=True)
    batch = TokenClassificationCollator(tok)([{"tokens": ["the", "lamb"], "labels": [1, 2]}])
    expected = [X if w is None else (1, 2)[w] for w in enc.word_ids]
    for i in range(1, len(expected)):  # non-first sub-tokens of a word
        if enc.word_ids[i] is not None and enc.word_ids[i] == enc.word_ids[i - 1]:
            expected[i] = X
    assert batch["input_ids"].tolist() == [enc.ids]
    assert batch["labels"].tolist() == [expected]
