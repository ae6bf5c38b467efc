"""Tiny models and batches for the tensor-parallel tests (importable by spawned ranks).

Sizes are chosen so padding is exercised: the decoder's 6 heads, 98-wide MLP and
250-token vocabulary do not divide by 4; GPT-2's 6 heads (fused q|k|v) neither.
"""

from __future__ import annotations

import torch

SEQ = 8
BATCH = 2


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
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=250,
            n_positions=32,
            n_embd=48,
            n_layer=2,
            n_head=6,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            attn_implementation="eager",
        )
        return GPT2LMHeadModel(cfg)
    if kind == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(
            vocab_size=250,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=80,
            max_position_embeddings=32,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        return BertForSequenceClassification(cfg)
    raise ValueError(kind)


def batch(kind: str, step: int = 0, size: int = BATCH) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 250, (size, SEQ), generator=g)
    if kind == "bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (size,), generator=g)}
    labels = ids.clone()
    labels[:, : SEQ // 4] = -100  # ignored positions, like a prompt
    if kind == "decoder":
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": labels}


def loss_of(model, kind: str, inputs: dict) -> torch.Tensor:
    if kind == "decoder":
        return model(inputs["input_ids"], inputs["labels"])
    return model(**inputs).loss
