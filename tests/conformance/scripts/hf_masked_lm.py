"""Masked language modelling with the Trainer, written the way transformers'
examples/pytorch/language-modeling MLM script is: (model, data, training) dataclasses
parsed by HfArgumentParser, a tiny BERT with its default dropout built from a config
(offline), a word-level tokenizer with a [MASK] token built from the corpus in the script,
the English chatterbot-corpus conversations as text, tokenized with special-token masks
and grouped into blocks, ``DataCollatorForLanguageModeling`` masking 15% of the tokens
from the global torch RNG (on training and evaluation batches, as the published script
does), accuracy on the masked tokens, perplexity, and a model card at the end."""

import importlib.util
import logging
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain

import datasets
import transformers
import yaml
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
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
    max_seq_length: int = field(default=16, metadata={"help": "tokens per block"})
    mlm_probability: float = 0.15
    max_train_samples: int | None = None
    max_eval_samples: int | None = None


def corpus_lines():
    root = importlib.util.find_spec("chatterbot_corpus").submodule_search_locations[0]
    lines = []
    for name in ("literature", "movies", "sports", "food", "money"):
        with open(os.path.join(root, "data", "english", f"{name}.yml"), encoding="utf-8") as f:
            for pair in yaml.safe_load(f)["conversations"]:
                lines += [str(turn) for turn in pair]
    return lines


def tokenizer_for(lines, size=300):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    norm = normalizers.Lowercase()
    split = pre_tokenizers.Whitespace()
    counts = Counter(
        w for line in lines for w, _ in split.pre_tokenize_str(norm.normalize_str(line))
    )
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate([*specials, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = norm, split
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
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

    lines = corpus_lines()
    tok = tokenizer_for(lines)
    text = datasets.Dataset.from_dict({"text": lines})
    split = text.train_test_split(test_size=0.1, shuffle=False)
    raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    block = data_args.max_seq_length

    def tokenize(batch):
        return tok(batch["text"], return_special_tokens_mask=True)

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // block * block
        return {k: [t[i : i + block] for i in range(0, total, block)] for k, t in joined.items()}

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
    with training_args.main_process_first(desc=f"grouping texts in chunks of {block}"):
        grouped = tokenized.map(group_texts, batched=True)
    train_dataset, eval_dataset = grouped["train"], grouped["validation"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(data_args.max_train_samples))
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(data_args.max_eval_samples))

    config = BertConfig(
        vocab_size=len(tok), hidden_size=model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers, num_attention_heads=2,
        intermediate_size=2 * model_args.hidden_size, max_position_embeddings=block,
    )  # fmt: skip
    model = BertForMaskedLM(config)

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        masked = labels != -100
        return {"accuracy": float((preds[masked] == labels[masked]).mean())}

    collator = DataCollatorForLanguageModeling(tok, mlm_probability=data_args.mlm_probability)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tok,
        data_collator=collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )
    if training_args.do_train:
        result = trainer.train()
        trainer.save_model()
        metrics = result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    kwargs = {"finetuned_from": "tiny-bert", "tasks": "fill-mask"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
