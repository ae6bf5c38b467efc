"""Tiny models and batches for the tensor-parallel tests (importable by spawned ranks).

Sizes are chosen so padding is exercised: the decoder's 6 heads, 98-wide MLP and
250-token vocabulary do not divide by 4; GPT-2's 6 heads (fused q|k|v) neither; Llama's
4 key/value heads (8 query heads) do not divide by 3. The transformers configs live in
``tests/tiny_models.py``.
"""

from __future__ import annotations

import torch

SEQ = 8
BATCH = 2
PAD = 0  # the sequence classifiers' padding token


def build(kind: str, dropout: float = 0.0):
    """A fresh, deterministically initialised tiny model of family ``kind``."""
    torch.manual_seed(7)
    if kind == "decoder":
        from meshtrain.models import Decoder, DecoderConfig

        return Decoder(
            DecoderConfig(
                vocab_size=250, dim=48, n_layers=2, n_heads=6, ffn_dim=98, max_seq_len=16, seed=3
            )
        )
    if kind == "llama":  # the project's tiny Llama, resized so GQA splits at tp 2 and 4
        from tests.tiny_models import tiny_llama

        return tiny_llama(
            seed=7,
            vocab_size=250,
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=8,
            num_key_value_heads=4,
            attn_implementation="sdpa",
        )
    if kind == "llama_cls":  # pools the last non-padding token; ``score`` replicated
        import transformers

        from tests.tiny_models import tiny_llama_config

        cfg = tiny_llama_config(
            vocab_size=250, hidden_size=48, intermediate_size=96, num_attention_heads=8,
            num_key_value_heads=4, num_labels=3, pad_token_id=PAD,
        )  # fmt: skip
        return transformers.LlamaForSequenceClassification(cfg)
    if kind == "gpt2":
        from tests.tiny_models import tiny_gpt2

        return tiny_gpt2(seed=7, dropout=dropout)
    if kind == "gpt2_cls":
        import transformers

        from tests.tiny_models import tiny_gpt2_config

        cfg = tiny_gpt2_config(dropout, num_labels=3, pad_token_id=PAD)
        return transformers.GPT2ForSequenceClassification(cfg)
    if kind in ("bert", "bert_mlm", "bert_tokens"):
        from tests.tiny_models import tiny_bert

        head = {
            "bert": "ForSequenceClassification",
            "bert_mlm": "ForMaskedLM",
            "bert_tokens": "ForTokenClassification",
        }[kind]
        return tiny_bert(head, seed=7, dropout=dropout)
    raise ValueError(kind)


def batch(kind: str, step: int = 0, size: int = BATCH, seq: int = SEQ) -> dict:
    """Global batch ``step``: ``size`` rows of ``seq`` tokens (a multiple of T under
    sequence parallelism), labels per family."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 250, (size, seq), generator=g)
    if kind == "bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (size,), generator=g)}
    if kind in ("llama_cls", "gpt2_cls"):  # right padding: each row pools another token
        ids = ids.clamp_min(1)
        for row in range(size):
            ids[row, seq - row % 3 :] = PAD
        mask = (ids != PAD).long()
        labels = torch.randint(0, 3, (size,), generator=g)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if kind == "bert_tokens":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (size, seq), generator=g)}
    labels = ids.clone()
    if kind == "bert_mlm":  # predict every other token: half the labels ignored
        labels[:, ::2] = -100
        return {"input_ids": ids, "labels": labels}
    labels[:, : seq // 4] = -100  # ignored positions, like a prompt
    return {"input_ids": ids, "labels": labels}


def loss_of(model, kind: str, inputs: dict) -> torch.Tensor:
    if kind == "decoder":
        return model(inputs["input_ids"], inputs["labels"])
    return model(**inputs).loss
