"""Sequence classification with the Trainer, written the way transformers' examples/pytorch
scripts are: (model, data, training) dataclasses parsed by HfArgumentParser, logging set
from the training arguments, a tiny BERT built from a config (offline), a word-level
tokenizer built in the script, datasets.map under main_process_first, train, evaluate,
log_metrics / save_metrics / save_state, and a model card at the end."""

import logging
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import transformers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    set_seed,
)

# isort: split
from transformers import Trainer, TrainingArguments  # peer-import

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    hidden_size: int = field(default=32, metadata={"help": "width of the tiny BERT"})
    num_hidden_layers: int = 2


@dataclass
class DataTrainingArguments:
    max_seq_length: int = field(default=16)
    max_train_samples: int | None = None


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a movie film was is good great bad awful plot acting really not".split()
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]",
    )  # fmt: skip


def rows(n, seed):
    rng = np.random.default_rng(seed)
    good, bad = ["good", "great", "really good"], ["bad", "awful", "not good"]
    out = {"sentence": [], "label": []}
    for _ in range(n):
        label = int(rng.integers(2))
        word = rng.choice(good if label else bad)
        out["sentence"].append(f"the {rng.choice(['movie', 'film', 'plot'])} was {word}")
        out["label"].append(label)
    return datasets.Dataset.from_dict(out)


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(
        format="%(levelname)s %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(
        f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
        f"n_gpu: {training_args.n_gpu}, distributed training: "
        f"{training_args.parallel_mode.value == 'distributed'}, 16-bits training: {training_args.fp16}"
    )
    set_seed(training_args.seed)

    tok = tokenizer()
    raw = datasets.DatasetDict({"train": rows(48, 0), "validation": rows(16, 1)})
    if data_args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(data_args.max_train_samples))

    def encode(batch):
        return tok(batch["sentence"], truncation=True, max_length=data_args.max_seq_length)

    with training_args.main_process_first(desc="dataset map tokenization"):
        encoded = raw.map(encode, batched=True, remove_columns=["sentence"])
    config = BertConfig(
        vocab_size=len(tok), hidden_size=model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers, num_attention_heads=2,
        intermediate_size=2 * model_args.hidden_size, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = BertForSequenceClassification(config)

    def compute_metrics(p):
        preds = np.argmax(p.predictions, axis=1)
        return {"accuracy": float((preds == p.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=encoded["validation"],
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=compute_metrics,
    )
    if training_args.do_train:
        result = trainer.train()
        metrics = result.metrics
        metrics["train_samples"] = len(encoded["train"])
        trainer.save_model()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(encoded["validation"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    kwargs = {"finetuned_from": "tiny-bert", "tasks": "text-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
