"""ZeRO stage 3 with a checkpoint that resumes anywhere: the script a crash-safe job needs.

    meshtrain launch --nproc_per_node 2 examples/zero3_resume.py --steps 20
    meshtrain launch --nproc_per_node 4 examples/zero3_resume.py --steps 40 --stage 1

The first command trains the reference decoder for 20 steps under ZeRO stage 3, saving
every 5 steps into ``--save-dir`` (default ``zero3-ckpt``). The second finds ``latest``,
loads it on 4 ranks under stage 1 with no conversion step, and goes on to step 40. Kill a
rank at any point and start it again (or launch with ``--max_restarts 1``): it resumes
from the last complete checkpoint. The data is a fixed synthetic token stream, so the
example runs offline; rank 0 prints the loss and the model-state memory report.
"""

from __future__ import annotations

import argparse

import torch

import meshtrain
from meshtrain.checkpoint import latest_tag
from meshtrain.models import Decoder, DecoderConfig


def batch(step: int, rank: int, micro: int, seq: int, vocab: int) -> torch.Tensor:
    """This rank's rows of global step ``step``: the same stream at any world size."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (64, seq), generator=g)[rank * micro : (rank + 1) * micro]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="train up to this global step")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (0-3)")
    parser.add_argument("--save-dir", default="zero3-ckpt")
    parser.add_argument("--save-every", type=int, default=5)
    args = parser.parse_args()

    cfg = DecoderConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, ffn_dim=352, max_seq_len=64)
    world = meshtrain.init_distributed().world_size
    micro = 16 // world  # a global batch of 16 rows at any world size
    engine, *_ = meshtrain.initialize(
        model=Decoder(cfg),
        config={
            "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
            "checkpoint": {"keep_last": 2},
        },
    )
    rank = engine.topology.dp_rank
    if latest_tag(args.save_dir) is not None:
        path, _ = engine.load_checkpoint(args.save_dir)
        if rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    while engine.global_steps < args.steps:
        ids = batch(engine.global_steps, rank, micro, 64, cfg.vocab_size)
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        if engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
        if rank == 0:
            print(f"step {engine.global_steps:4d}  loss {loss.item():.4f}", flush=True)
    report = engine.memory_report()
    if rank == 0:
        print(report)


if __name__ == "__main__":
    main()
