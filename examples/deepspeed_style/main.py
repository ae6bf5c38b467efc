"""Chat fine-tuning written the DeepSpeed way (seed 001's ChatGLM script), run by meshtrain.

The only DeepSpeed-specific line is the import: ``import meshtrain as deepspeed``.
Swap it for ``import deepspeed`` and the same file runs on DeepSpeed (the tests do, and
compare the losses). From this directory::

    meshtrain launch --hostfile hostfile --master_port 9000 main.py \\
        --deepspeed --deepspeed_config ds_config.json --output_dir out --max_steps 8

``hostfile`` says ``localhost slots=2``: two processes on this machine (CPU and gloo
here; GPUs and NCCL where there are some). The data are the English question/answer
pairs of the ``chatterbot-corpus`` package, rendered with meshtrain's chat template and
collator (loss on the answer only), byte-level tokens, and a 2-layer decoder small
enough to train in seconds on a CPU. Run it a second time with a larger
``--max_steps``: it resumes from ``out/latest`` with the ``client_state`` it saved.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os

import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

import meshtrain as deepspeed
from meshtrain.data.chat_data import ChatCollator
from meshtrain.models import Decoder, DecoderConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="chat fine-tuning, DeepSpeed style")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--output_dir", default="out", help="checkpoints (resumed from)")
    parser.add_argument("--language", default="english", help="chatterbot-corpus language")
    parser.add_argument("--max_len", type=int, default=64, help="tokens per example")
    parser.add_argument("--max_steps", type=int, default=8, help="optimizer steps in all")
    parser.add_argument("--save_steps", type=int, default=4, help="0: never save")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args()
    args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    return args


def chat_records(language: str) -> list[dict]:
    """prompt/response/history records from every conversation of the corpus."""
    root = importlib.util.find_spec("chatterbot_corpus").submodule_search_locations[0]
    records = []
    for path in sorted(glob.glob(os.path.join(root, "data", language, "*.yml"))):
        with open(path, encoding="utf-8") as f:
            conversations = yaml.safe_load(f).get("conversations") or []
        for turns in conversations:
            turns = [str(t) for t in turns]
            history = []
            for q, a in zip(turns[0::2], turns[1::2], strict=False):
                records.append({"prompt": q, "response": a, "history": list(history)})
                history.append([q, a])
    return records


class ChatLM(nn.Module):
    """The decoder, called with the collator's keys (the causal mask makes right padding
    harmless, so ``attention_mask`` is not needed)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.decoder = Decoder(config)

    def forward(self, input_ids, labels, attention_mask=None):
        return self.decoder(input_ids, labels)


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    with open(args.deepspeed_config) as f:
        conf = json.load(f)

    records = chat_records(args.language)
    coll_fn = ChatCollator("byte", max_length=args.max_len)
    model = ChatLM(
        DecoderConfig(vocab_size=260, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=128)
    )
    if args.local_rank == -1:
        train_sampler = RandomSampler(records)
    else:
        train_sampler = DistributedSampler(records, shuffle=True, seed=args.seed)
    train_dataloader = DataLoader(
        records,
        batch_size=conf["train_micro_batch_size_per_gpu"],
        sampler=train_sampler,
        collate_fn=coll_fn,
        drop_last=True,
        num_workers=0,
    )

    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    _, client_state = model_engine.load_checkpoint(args.output_dir)
    done = client_state["micro_steps"] if client_state else 0
    if done and model_engine.global_rank == 0:
        print(f"resumed from {args.output_dir} after {done} micro-steps", flush=True)

    gas = model_engine.gradient_accumulation_steps()
    micro, epoch = 0, 0
    while micro < args.max_steps * gas:
        if isinstance(train_sampler, DistributedSampler):
            train_sampler.set_epoch(epoch)
        for batch in train_dataloader:
            if micro >= args.max_steps * gas:
                break
            if micro < done:  # already trained before the checkpoint
                micro += 1
                continue
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            loss = model_engine(**batch)  # forward and loss
            model_engine.backward(loss)  # backward
            model_engine.step()  # optimizer update at the accumulation boundary
            if model_engine.global_rank == 0:
                print(f"micro {micro} loss {loss.item():.8f}", flush=True)
            micro += 1
            step = micro // gas
            if micro % gas == 0 and args.save_steps and step % args.save_steps == 0:
                model_engine.save_checkpoint(args.output_dir, client_state={"micro_steps": micro})
        epoch += 1
    if model_engine.global_rank == 0:
        print(f"done: {micro // gas} steps, lr {model_engine.get_lr()[0]:.6f}", flush=True)


if __name__ == "__main__":
    main()
