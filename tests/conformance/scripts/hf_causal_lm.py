"""Causal language modelling with the Trainer, written the way transformers'
examples/pytorch/language-modeling scripts are: (model, data, training) dataclasses parsed
by HfArgumentParser, a tiny Llama built from a config (offline, ``AutoConfig.for_model``),
a word-level tokenizer built from the corpus in the script, the English
chatterbot-corpus conversations as text, tokenize then ``group_texts`` into blocks under
main_process_first, ``default_data_collator``, token accuracy from
``preprocess_logits_for_metrics``, perplexity, and a model card at the end."""

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
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    default_data_collator,
    set_seed,
)

# isort: split
from transformers import Trainer, TrainingArguments  # peer-import

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_type: str = field(default="llama", metadata={"help": "a config type, from scratch"})
    hidden_size: int = 32
    num_hidden_layers: int = 2


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=16, metadata={"help": "tokens per training block"})
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    validation_split_percentage: int = 10


def corpus_lines():
    root = importlib.util.find_spec("chatterbot_corpus").submodule_search_locations[0]
    lines = []
    for name in ("ai", "computers", "science", "history"):
        with open(os.path.join(root, "data", "english", f"{name}.yml"), encoding="utf-8") as f:
            for pair in yaml.safe_load(f)["conversations"]:
                lines += [str(turn) for turn in pair]
    return lines


def tokenizer_for(lines, size=300):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    norm = normalizers.Lowercase()
    split = pre_tokenizers.Whitespace()
    counts = Counter(
        w for line in lines for w, _ in split.pre_tokenize_str(norm.normalize_str(line))
    )
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer = norm, split
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


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
    logger.warning(
        f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
        f"n_gpu: {training_args.n_gpu}, distributed training: "
        f"{training_args.parallel_mode.value == 'distributed'}"
    )
    set_seed(training_args.seed)

    lines = corpus_lines()
    tok = tokenizer_for(lines)
    text = datasets.Dataset.from_dict({"text": lines})
    cut = len(lines) * data_args.validation_split_percentage // 100
    raw = datasets.DatasetDict(
        {"validation": text.select(range(cut)), "train": text.select(range(cut, len(lines)))}
    )

    def tokenize(batch):
        out = tok(batch["text"])
        out["input_ids"] = [ids + [tok.eos_token_id] for ids in out["input_ids"]]
        out["attention_mask"] = [mask + [1] for mask in out["attention_mask"]]
        return out

    block_size = data_args.block_size

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // block_size * block_size  # the tail is dropped
        result = {
            k: [t[i : i + block_size] for i in range(0, total, block_size)]
            for k, t in joined.items()
        }
        result["labels"] = [ids.copy() for ids in result["input_ids"]]
        return result

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
    with training_args.main_process_first(desc="grouping texts together"):
        lm = tokenized.map(group_texts, batched=True)
    train_dataset, eval_dataset = lm["train"], lm["validation"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(data_args.max_train_samples))
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(data_args.max_eval_samples))

    config = AutoConfig.for_model(
        model_args.model_type, vocab_size=len(tok), hidden_size=model_args.hidden_size,
        intermediate_size=2 * model_args.hidden_size, num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=block_size,
        eos_token_id=tok.eos_token_id, pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
        return {"accuracy": float((preds == labels).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tok,
        data_collator=default_data_collator,
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
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    kwargs = {"finetuned_from": "tiny-llama", "tasks": "text-generation"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
