"""Rank functions of the asynchronous-save and pre-emption tests (tests.harness)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch


def _tensors(save_dir, tag):
    from meshtrain.checkpoint import CheckpointReader

    with CheckpointReader(save_dir, tag) as r:
        return {(n, s): r.read_full(n, s).clone() for s in r.states() for n in r.names(s)}, r.meta[
            "global_steps"
        ]


def async_matches_sync(out):
    """Two engines, same seed and data: one saves synchronously, the other asynchronously
    and trains on while its write runs. Both checkpoints must hold the same bytes (the
    staged copy is the state at the save, not later), a second async save waits for the
    first, a failed background write raises at the next step, and a run resumed from the
    async checkpoint continues exactly like the uninterrupted one."""
    import torch.distributed as dist

    from meshtrain.errors import CheckpointError
    from tests.distributed.training import make_engine, train_steps

    out = Path(out)
    zero = {"zero_optimization": {"stage": 2}}
    sync = make_engine("decoder", 2, 1, zero)
    train_steps(sync, "decoder", 2, 2, 1)
    sync.save_checkpoint(out / "sync")
    sync_losses, *_ = train_steps(sync, "decoder", 2, 2, 1, first_step=2)

    eng = make_engine("decoder", 2, 1, {**zero, "checkpoint": {"async_save": True}})
    train_steps(eng, "decoder", 2, 2, 1)
    path = eng.save_checkpoint(out / "async")
    # the write runs while the step changes every master weight and optimizer state
    async_losses, *_ = train_steps(eng, "decoder", 2, 2, 1, first_step=2)
    eng.save_checkpoint(out / "async", tag="second")  # waits for the first
    done = eng.wait_for_checkpoint()
    result = {
        "path": str(path),
        "done": str(done),
        "same_losses": sync_losses == async_losses,
    }
    a, a_step = _tensors(out / "async", "global_step2")
    s, s_step = _tensors(out / "sync", "global_step2")
    result["steps"] = (a_step, s_step)
    result["same_bytes"] = a.keys() == s.keys() and all(torch.equal(a[k], s[k]) for k in a)
    result["latest"] = (out / "async" / "latest").read_text()

    # a failing background write (save_dir under a regular file) raises at the next step
    (out / "blocker").write_text("x")
    eng.save_checkpoint(out / "blocker" / "ckpt")
    try:
        while eng.checkpoint_saver.busy:  # let it fail first: the step must report it
            time.sleep(0.05)
        train_steps(eng, "decoder", 1, 2, 1, first_step=4)
        result["failure"] = None
    except CheckpointError as exc:
        result["failure"] = str(exc)
    eng.save_checkpoint(out / "async", tag="after_failure")  # the saver still works
    eng.wait_for_checkpoint()
    result["after_failure"] = (out / "async" / "latest").read_text()

    # resume from the async checkpoint: the next two steps equal the uninterrupted run's
    again = make_engine("decoder", 2, 1, zero)
    again.load_checkpoint(out / "async", tag="global_step2")
    resumed, *_ = train_steps(again, "decoder", 2, 2, 1, first_step=2)
    result["resumed_exact"] = resumed == sync_losses
    dist.barrier()
    return result


def preempt_user_loop(out, signal_at, second_signal):
    """An engine user loop with ``checkpoint.save_on_preemption``: rank 1 sends itself
    SIGTERM during step ``signal_at`` (and, with ``second_signal``, SIGUSR1 during the
    save). Returns what ``Preempted`` said, or the step reached."""
    import torch.distributed as dist

    from meshtrain.engine.preemption import Preempted
    from tests.distributed.training import make_engine, train_steps

    cfg = {
        "zero_optimization": {"stage": 1},
        "checkpoint": {"save_on_preemption": True, "save_dir": str(Path(out) / "ckpt")},
    }
    eng = make_engine("decoder", 2, 1, cfg)
    if second_signal and dist.get_rank() == 0:
        from meshtrain.engine import checkpoint_save as engine_io

        real = engine_io.save_shards

        def save_with_signal(*a, **kw):
            os.kill(os.getpid(), signal.SIGUSR1)  # a second signal in the middle of the save
            return real(*a, **kw)

        engine_io.save_shards = save_with_signal
    try:
        for step in range(10):
            if step == signal_at and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            train_steps(eng, "decoder", 1, 2, 1, first_step=step)
    except Preempted as exc:
        return {"code": exc.code, "step": exc.step, "path": str(exc.path),
                "received": list(eng.preemption.received)}  # fmt: skip
    return {"code": None, "step": eng.global_steps}
