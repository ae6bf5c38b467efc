"""Rank functions for the serve tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import torch


def train_zero3_and_save(save_dir: str, bert_cfg: dict, llama_cfg: dict) -> dict:
    """Train a tiny BERT classifier and a tiny Llama for 2 steps each under ZeRO stage 3
    on every rank, saving a sharded checkpoint after each step (``<save_dir>/<name>``).
    Rank 0 returns the full (gathered) weights after each step for the test to compare."""
    import torch.distributed as dist
    import transformers

    import meshtrain

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    jobs = [
        ("classifier", transformers.BertForSequenceClassification, bert_cfg),
        ("chat", transformers.LlamaForCausalLM, llama_cfg),
    ]
    for name, cls, cfg_dict in jobs:
        cfg = type(cls.config_class()).from_dict(cfg_dict)
        torch.manual_seed(0)
        model = cls(cfg)
        engine, *_ = meshtrain.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 5e-2}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            },
        )
        states = []
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(5, cfg.vocab_size, (2 * world, 16), generator=g)
            ids = ids[2 * rank : 2 * rank + 2]
            if name == "classifier":
                batch = {"input_ids": ids, "labels": torch.tensor([0, 1])}
            else:
                batch = {"input_ids": ids, "labels": ids}
            engine.backward(engine(**batch))
            engine.step()
            engine.save_checkpoint(f"{save_dir}/{name}")
            full = engine.module_state_dict()
            states.append({k: v.detach().clone() for k, v in full.items()})
        out[name] = states
    return out if rank == 0 else {}
