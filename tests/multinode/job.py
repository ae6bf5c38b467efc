"""The job the multi-node tests run on every node (under ``meshtrain launch``).

    job.py OUT_DIR [--steps 8] [--save_every 2] [--timeout_s 6] [--first_step_timeout_s S]
                   [--step_sleep 0] [--model decoder] [--stage 2]
                   [--warmup_s 0 --warmup_node 1]

ZeRO-2 on the tiny decoder, fp32, the parity protocol of tests/distributed/training.py
(rank r takes its rows of the same global batch), so the final parameters depend only on
the world size, not on how the ranks are spread over nodes. It resumes from
``OUT_DIR/checkpoints`` (the shared folder) when a checkpoint is there, saves every
``--save_every`` steps, writes ``OUT_DIR/step`` (the last finished step, for the test to
pick its moment) and, on rank 0, ``OUT_DIR/final.safetensors``. ``--step_sleep`` slows
each step so that a fault lands between collectives of a running job. ``--warmup_s``
makes the ranks of ``--warmup_node`` sleep before their first step (a node still compiling
or loading while the others wait in the first collective).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for tests.*


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save_every", type=int, default=2)
    p.add_argument("--timeout_s", type=float, default=6.0)
    p.add_argument("--step_sleep", type=float, default=0.0)
    p.add_argument("--first_step_timeout_s", type=float, default=None)
    p.add_argument("--model", default="decoder")
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage (a node may differ)")
    p.add_argument("--warmup_s", type=float, default=0.0)
    p.add_argument("--warmup_node", type=int, default=1)
    a = p.parse_args()

    import torch.distributed as dist
    from safetensors.torch import save_file

    from meshtrain.checkpoint import latest_tag
    from tests.distributed.training import make_engine, train_steps

    config = {
        "zero_optimization": {"stage": a.stage},
        "distributed": {"timeout_minutes": a.timeout_s / 60},
    }
    if a.first_step_timeout_s is not None:  # start-up, resume and the first step wait longer
        config["distributed"]["first_step_timeout_minutes"] = a.first_step_timeout_s / 60
    engine = make_engine(a.model, 2, 1, config)
    out = Path(a.out)
    ckpt = out / "checkpoints"
    rank = dist.get_rank()
    import os

    seen = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "MESHTRAIN_TEST_MARK")}
    print(f"rank {rank}: group {os.environ.get('GROUP_RANK')} env {seen}", flush=True)
    if latest_tag(ckpt) is not None:
        engine.load_checkpoint(ckpt)
        print(f"rank {rank}: resumed at step {engine.global_steps}", flush=True)
    if int(os.environ.get("GROUP_RANK", "0")) == a.warmup_node:
        time.sleep(a.warmup_s)
    for step in range(engine.global_steps, a.steps):
        train_steps(engine, a.model, 1, 2, 1, first_step=step)
        if (step + 1) % a.save_every == 0:
            engine.save_checkpoint(ckpt)
        if rank == 0:
            (out / "step").write_text(str(step + 1))
        time.sleep(a.step_sleep)
    state = engine.module_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, f"{out}/final.safetensors")
    print(f"rank {rank}: done at step {engine.global_steps}", flush=True)


if __name__ == "__main__":
    main()
