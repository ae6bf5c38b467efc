"""ChatCollator: template rendering, loss on response tokens only, truncation keeps the response.

With the byte tokenizer a text's ids are its UTF-8 bytes, so ``list(b"...")`` is the
hand-computed expectation; <pad>=256, <bos>=257, <eos>=258.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.data import ByteTokenizer, ChatCollator, ChatTemplate
from meshtrain.errors import DataError

PAD, BOS, EOS = 256, 257, 258
X = -100
TEMPLATE = ChatTemplate(turn="Q:{query}\nA:{answer}\n", prompt="Q:{query}\nA:")
RECORD = {"prompt": "hi", "response": "yo", "history": [["a", "b"]]}


def ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_render_and_labels_on_response_only():
    coll = ChatCollator(ByteTokenizer(), template=TEMPLATE)
    source = [BOS] + ids("Q:a\nA:b\n") + ids("Q:hi\nA:")
    response = ids("yo") + [EOS]
    assert coll.encode(RECORD) == {
        "input_ids": source + response,
        "labels": [X] * len(source) + response,
    }
    batch = coll([RECORD, {"prompt": "x", "response": "z"}])  # no history
    short = [BOS] + ids("Q:x\nA:") + ids("z") + [EOS]
    n = len(source) + len(response)
    assert torch.equal(batch["input_ids"][1], torch.tensor(short + [PAD] * (n - len(short))))
    assert torch.equal(
        batch["labels"][1], torch.tensor([X] * 7 + ids("z") + [EOS] + [X] * (n - len(short)))
    )
    assert torch.equal(batch["attention_mask"].sum(1), torch.tensor([n, len(short)]))


def test_truncation_keeps_the_response():
    tok = ByteTokenizer()
    # 12 tokens: history round dropped, prompt kept whole
    coll = ChatCollator(tok, template=TEMPLATE, max_length=12)
    assert coll.encode(RECORD)["input_ids"] == [BOS] + ids("Q:hi\nA:") + ids("yo") + [EOS]
    # 8 tokens: the prompt is cut from the left, its end (the answer cue) stays
    out = ChatCollator(tok, template=TEMPLATE, max_length=8).encode(RECORD)
    assert out["input_ids"] == [BOS] + ids("i\nA:") + ids("yo") + [EOS]
    assert out["labels"] == [X] * 5 + ids("yo") + [EOS]
    # a response that alone fills max_length is cut at its end, one source token kept
    out = ChatCollator(tok, template=TEMPLATE, max_length=4).encode(RECORD)
    assert out == {"input_ids": [BOS, ord(":"), *ids("yo")], "labels": [X, X, *ids("yo")]}
    out = ChatCollator(tok, template=TEMPLATE, max_response_length=2).encode(RECORD)
    assert out["labels"][-2:] == ids("yo") and out["input_ids"][-1] != EOS


def test_chatglm_template_matches_the_seeds_format():
    rounds, prompt = ChatTemplate.chatglm().render(
        "你好", [["", "您好,请问是张先生吗?"], ["是。", "喂"]]
    )
    assert "".join(rounds) + prompt == (
        "[Round 0]\n问:\n答:您好,请问是张先生吗?\n[Round 1]\n问:是。\n答:喂\n[Round 2]\n问:你好\n答:"
    )
    coll = ChatCollator(ByteTokenizer(), template=ChatTemplate.chatglm(), add_bos=False)
    out = coll.encode({"prompt": "你好", "response": "嗯", "history": []})
    assert out["input_ids"] == ids("[Round 0]\n问:你好\n答:") + ids("嗯") + [EOS]


def test_bad_records():
    coll = ChatCollator(ByteTokenizer(), template=TEMPLATE)
    with pytest.raises(DataError, match="missing 'response'"):
        coll([{"prompt": "hi"}])
    with pytest.raises(DataError, match=r"history\[0\].*not a \[query, answer\] pair"):
        coll([{"prompt": "hi", "response": "x", "history": [["only one"]]}])
