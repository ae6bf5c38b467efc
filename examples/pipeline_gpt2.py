"""Train a small GPT-2 with pipeline parallelism (offline, CPU or GPU).

    meshtrain launch --nproc_per_node 2 examples/pipeline_gpt2.py
    meshtrain launch --nproc_per_node 4 examples/pipeline_gpt2.py --pp 2   # pp 2 x dp 2
    meshtrain launch --nproc_per_node 2 examples/pipeline_gpt2.py --schedule interleaved_1f1b --virtual-stages 2

The model is split automatically (embeddings on the first stage, the tied LM head and
loss on the last); each step runs ``--micro-batches`` micro-batches through the chosen
schedule, which rank 0 prints as a table first. The text is a few sentences repeated,
tokenised by bytes, in windows of varying length, so the loss falls quickly.
"""

from __future__ import annotations

import argparse

import torch

import meshtrain
from meshtrain.parallel.pipeline.schedules import build_schedule

TEXT = (
    "Pipeline parallelism cuts a model into stages. Each stage runs on its own rank. "
    "Micro-batches flow forward through the stages and gradients flow back. "
) * 40


def batches(rows: int, step: int, dp_rank: int, dp: int):
    """Endless micro-batches of byte windows; lengths vary from 24 to 63 tokens."""
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(step)
    while True:
        length = int(torch.randint(24, 64, (1,), generator=g))
        starts = torch.randint(0, len(data) - length, (rows * dp,), generator=g)
        ids = torch.stack([data[s : s + length] for s in starts])[dp_rank::dp]
        yield {"input_ids": ids, "labels": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=None, help="pipeline size (default: all ranks)")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    meshtrain.init_distributed()
    world = torch.distributed.get_world_size()
    pp = args.pp or world
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_layer=4,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    engine, *_ = meshtrain.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": args.micro_batches,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "gradient_clipping": 1.0,
            "steps_per_print": 10,
            "mesh": {"pipeline_parallel_size": pp},
            "pipeline": {"schedule": args.schedule, "virtual_stages": args.virtual_stages},
        },
    )
    topo = engine.topology
    if topo.rank == 0:
        print(build_schedule(args.schedule, pp, args.micro_batches, args.virtual_stages).table())
    it = batches(4, 0, topo.dp_rank, topo.dp_size)
    for step in range(args.steps):
        loss = engine.train_batch(it)
        if topo.rank == 0 and step % 10 == 0:
            print(
                f"step {step:3d} loss {loss.item():.3f} grad norm "
                f"{engine.get_global_grad_norm():.3f}"
            )
    val = engine.eval_batch(batches(7, 123, 0, 1), num_micro_batches=2)  # any batch size
    if topo.rank == 0:
        print(f"final loss {loss.item():.3f}, evaluation loss {val.item():.3f}")


if __name__ == "__main__":
    main()
