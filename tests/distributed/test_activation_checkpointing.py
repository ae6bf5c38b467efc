"""Activation checkpointing on transformers models whose key/value cache is on.

A block recomputed in backward must not append its keys to the cache a second time
(``parallel/activation_checkpointing.py``). For a GPT-2 (the cache reaches each block by
position) and a Llama (by keyword), both with ``use_cache`` True and a padded batch (a
4-D mask, not ``is_causal``): 3 AdamW steps through ``meshtrain.initialize`` with
checkpointing on match the same steps with it off exactly: the recomputed forward runs
the same fp32 operations in the same order, only the autograd graph differs
(``tests/tolerance.py``, case 1: bitwise). Then greedy
``generate`` (under ``no_grad``, where the cache must still work) gives the same tokens.
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks


def _train(kind: str, checkpointing: bool):
    import meshtrain
    from tests.tiny_models import tiny_gpt2, tiny_llama

    model = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    model.config.use_cache = True
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {"enabled": checkpointing},
    }
    engine, *_ = meshtrain.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        ids = torch.randint(3, 60, (2, 6), generator=g)
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, 4:] = 0  # right padding: a real 4-D mask
        loss = engine(input_ids=ids, attention_mask=mask, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        tokens = model.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, tokens.tolist()


def _runs():
    torch.set_num_threads(1)
    return {(k, ac): _train(k, ac) for k in ("gpt2", "llama") for ac in (False, True)}


def test_checkpointed_blocks_ignore_the_cache_while_training():
    (out,) = run_ranks(_runs, 1)
    for kind in ("gpt2", "llama"):
        (l0, p0, t0), (l1, p1, t1) = out[(kind, False)], out[(kind, True)]
        assert l0 == l1, (kind, l0, l1)
        assert p0.keys() == p1.keys()
        for n, t in p0.items():
            assert torch.equal(p1[n], t), (kind, n)
        assert t1 == t0 and len(t1[0]) == 8, (kind, t0, t1)
