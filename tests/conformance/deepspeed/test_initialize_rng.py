"""``meshtrain.initialize`` (the DeepSpeed-style front door) draws nothing from the user's
random streams: the global torch, python and numpy RNG states are identical before and
after it, for a model whose shape turns the MFU set-up on (a transformers BERT: the CPU's
matmul peak is measured then, on operands from a private generator). Exact comparison."""

from __future__ import annotations

import random

import numpy as np
import torch


def test_initialize_leaves_the_global_rng_alone():
    from transformers import BertConfig, BertForSequenceClassification

    import meshtrain

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(cfg)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    meshtrain.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "steps_per_print": 1000,
        },
    )
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
