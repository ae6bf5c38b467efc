"""A training script for the killed-rank recovery test, run under torchrun.

Loads ``latest`` at start when there is one, trains the tiny decoder under ZeRO stage 2
to ``STEPS`` optimizer steps with a checkpoint every 2 steps, and on the first attempt
(TORCHELASTIC_RESTART_COUNT 0) SIGKILLs rank 1 right after step ``kill_at``. Rank 0
writes the final parameters to ``out_dir/final.safetensors``.

Usage: torchrun ... recovery_worker.py OUT_DIR KILL_AT   (KILL_AT -1: never)
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for tests.*

STEPS = 8


def main(out_dir: str, kill_at: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from meshtrain.checkpoint import latest_tag
    from tests.distributed.training import make_engine, train_steps

    engine = make_engine("decoder", 2, 1, {"zero_optimization": {"stage": 2}})
    ckpt = Path(out_dir) / "checkpoints"
    if latest_tag(ckpt) is not None:
        engine.load_checkpoint(ckpt)
        print(f"rank {dist.get_rank()}: resumed at step {engine.global_steps}", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(engine.global_steps, STEPS):
        train_steps(engine, "decoder", 1, 2, 1, first_step=step)
        if (step + 1) % 2 == 0:
            engine.save_checkpoint(ckpt)
        if step == kill_at and attempt == 0 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    state = engine.module_state_dict()
    if dist.get_rank() == 0:
        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(Path(out_dir) / "final.safetensors")
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
