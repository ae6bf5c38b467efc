"""Module-level functions the checkpoint tests run on real gloo ranks (tests.harness)."""

from __future__ import annotations

import os
import random
import signal

import torch


def _world():
    from meshtrain.distributed.topology import Topology

    return Topology().group("world")


def _save(save_dir, tag, group, seed, *, on_phase=None, keep_last=None, drop_piece=False):
    from meshtrain.checkpoint import save_shards
    from tests.checkpoint.common import full_state, meta, shard

    tensors, pieces = shard(full_state(seed), group.rank, group.size)
    if drop_piece:
        pieces = pieces[1:]
    state = {
        "python_rng": random.getstate(),
        "sampler": {"epoch": 1, "consumed": 10 * group.rank},
        "scheduler": {"last_epoch": 7, "base_lrs": [0.1]},
    }
    return save_shards(
        save_dir,
        tag,
        group=group,
        tensors=tensors,
        pieces=pieces,
        rank_state=state,
        meta=meta(seed=seed) if group.rank == 0 else None,
        keep_last=keep_last,
        on_phase=on_phase,
    )


def save_and_misuse(save_dir):
    """A good 2-rank save, then saves that must fail on every rank without a hang."""
    from meshtrain.checkpoint import Piece, latest_tag, save_shards
    from meshtrain.errors import CheckpointError
    from tests.checkpoint.common import full_state, meta, shard

    g = _world()
    phases = []
    path = _save(save_dir, "global_step7", g, 0, on_phase=phases.append)
    out = {"path": str(path), "phases": phases, "errors": {}}

    def expect_error(label, fn):
        try:
            fn()
        except CheckpointError as exc:
            out["errors"][label] = str(exc)
        else:
            out["errors"][label] = None

    tensors, pieces = shard(full_state(1), g.rank, g.size)
    if g.rank == 1:  # only rank 1 is wrong: a piece pointing at a key it does not have
        pieces = [*pieces, Piece("layer.b", "param", "nope", 0, 0, 1)]
    expect_error(
        "bad_key",
        lambda: save_shards(save_dir, "bad1", group=g, tensors=tensors, pieces=pieces, meta=meta()),
    )
    # rank 1 forgets a piece: only rank 0 can see the gap, at commit
    expect_error("gap", lambda: _save(save_dir, "bad2", g, 1, drop_piece=g.rank == 1))
    tensors, pieces = shard(full_state(1), g.rank, g.size)
    bad_state = {"sched": {"lr": torch.tensor(0.1)}} if g.rank == 0 else {}
    expect_error(
        "not_json",
        lambda: save_shards(
            save_dir,
            "bad3",
            group=g,
            tensors=tensors,
            pieces=pieces,
            rank_state=bad_state,
            meta=meta(),
        ),
    )
    out["latest_after_errors"] = latest_tag(save_dir)
    out["entries"] = sorted(os.listdir(save_dir))
    return out


def save_twice_and_kill(save_dir, second_tag, kill_phase, kill_rank):
    """Save tag "a" (seed 0), then ``second_tag`` (seed 1), SIGKILLing ``kill_rank`` when
    the second save reaches ``kill_phase``."""
    g = _world()
    _save(save_dir, "a", g, 0)

    def on_phase(name):
        if name == kill_phase and g.rank == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    _save(save_dir, second_tag, g, 1, on_phase=on_phase)
    return "not killed"
