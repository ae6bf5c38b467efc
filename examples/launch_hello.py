"""Hello from every rank: the smallest job ``meshtrain launch`` can run.

    meshtrain launch --nproc_per_node 2 examples/launch_hello.py
    meshtrain launch --nnodes 2 --node_rank 0 --rdzv_endpoint 127.0.0.1:29400 \\
        examples/launch_hello.py          # and --node_rank 1 in a second terminal

Each rank adds ``rank + 1`` in a few all-reduces and gathers which node it runs on, so
the output proves every rank on every node took part. ``--fail-rank R --exit-code C``
makes rank R exit with code C, which ``meshtrain launch`` passes through as its own.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import meshtrain


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="all-reduces to run")
    parser.add_argument("--fail-rank", type=int, default=-1, help="rank that exits non-zero")
    parser.add_argument("--exit-code", type=int, default=0, help="its exit code")
    args = parser.parse_args()

    # joins the group torchrun's variables describe; cleanup (barrier + destroy) at exit
    env = meshtrain.init_distributed()
    value = torch.tensor([float(env.rank + 1)])
    for _ in range(args.steps):
        total = value.clone()
        dist.all_reduce(total)
    nodes: list[str | None] = [None] * env.world_size
    dist.all_gather_object(nodes, os.environ.get("GROUP_RANK", "0"))
    expected = env.world_size * (env.world_size + 1) / 2
    line = (
        f"rank {env.rank}/{env.world_size} local_rank {env.local_rank} "
        f"node {os.environ.get('GROUP_RANK', '0')} sum {total.item():g} "
        f"expected {expected:g} nodes {','.join(sorted(set(nodes)))}\n"
    )
    # one write per line: under `python -u` print() writes text and newline separately,
    # and the ranks' lines would interleave
    sys.stdout.write(line)
    sys.stdout.flush()
    if total.item() != expected:
        return 1
    return args.exit_code if env.rank == args.fail_rank else 0


if __name__ == "__main__":
    sys.exit(main())
