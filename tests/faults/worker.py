"""The training job the fault campaigns and the recovery test break (run under
``meshtrain launch`` or torchrun).

worker.py train OUT_DIR KILL_RANK KILL_AT   ZeRO-2 tiny decoder, STEPS optimizer steps,
                                            a checkpoint every 2; on the first attempt
                                            rank KILL_RANK SIGKILLs itself after step
                                            KILL_AT (-1: never); resumes from latest
worker.py saves OUT_DIR [async]             one step then a checkpoint, over and over
                                            (the campaign kills it mid-save); async:
                                            checkpoint.async_save, pids in OUT_DIR/pids
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for tests.*

STEPS = 8


def train(out_dir: str, kill_rank: int, kill_at: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from meshtrain.checkpoint import latest_tag
    from tests.distributed.training import make_engine, train_steps

    engine = make_engine("decoder", 2, 1, {"zero_optimization": {"stage": 2}})
    ckpt = Path(out_dir) / "checkpoints"
    if latest_tag(ckpt) is not None:
        engine.load_checkpoint(ckpt)
        print(
            f"rank {dist.get_rank()}: resumed at step {engine.global_steps}\n", end="", flush=True
        )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(engine.global_steps, STEPS):
        train_steps(engine, "decoder", 1, 2, 1, first_step=step)
        if (step + 1) % 2 == 0:
            engine.save_checkpoint(ckpt)
        if step == kill_at and attempt == 0 and dist.get_rank() == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
    state = engine.module_state_dict()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, f"{out_dir}/final.safetensors")


def saves(out_dir: str, mode: str = "sync") -> None:
    import torch.distributed as dist

    from tests.distributed.training import make_engine, train_steps

    config = {"zero_optimization": {"stage": 2}}
    if mode == "async":  # written in the background while the next steps run
        config["checkpoint"] = {"async_save": True}
    engine = make_engine("decoder", 2, 1, config)
    if mode == "async":
        pids = Path(out_dir) / "pids"
        pids.mkdir(exist_ok=True)
        (pids / f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    ckpt = Path(out_dir) / "checkpoints"
    for step in range(10_000):
        train_steps(engine, "decoder", 1, 2, 1, first_step=step)
        engine.save_checkpoint(ckpt)
        if step == 0:
            Path(out_dir, "first_save_done").write_text("1")


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        saves(sys.argv[2], *sys.argv[3:4])
