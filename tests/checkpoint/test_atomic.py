"""Crash safety and retention.

A rank is SIGKILLed (from ``on_phase``) at each phase of a second save; the harness reports
the dead rank and kills the rest (a survivor blocked in a collective never hangs the test:
the parent watches exit codes, and the timeout is 60 s). What must be left behind, by phase
(see meshtrain.checkpoint.writer):

- shard_written (rank 1 of 2), manifest_written (rank 0 of 2): ``latest`` = "a", "b" absent
- renamed: ``latest`` = "a"; "b" is complete and listed but not latest
- latest_written: ``latest`` = "b"
- moved_aside while overwriting "a" itself: ``latest`` = "a" and its *old* content loads
  (from ``.old-a``); the next save puts it back in place

Then a save of the same tag from a fresh process must succeed and clean up.
Values are exact copies, so equality is exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from meshtrain.checkpoint import CheckpointReader, Piece, latest_tag, list_tags, save_shards
from meshtrain.checkpoint.storage import apply_retention
from meshtrain.errors import CheckpointError
from tests.checkpoint import ranks
from tests.checkpoint.common import full_state, meta, shard
from tests.harness import RankFailedError, run_ranks


def _assert_holds(save_dir, tag, seed):
    r = CheckpointReader(save_dir, tag)
    full = full_state(seed)
    for state in ("param", "exp_avg"):
        for name, t in full[state].items():
            assert torch.equal(r.read_full(name, state), t), (tag, name, state)
    assert r.meta["seed"] == seed


def _save_local(save_dir, tag, seed, **kw):
    """A one-process save (group=None) with the same layouts."""
    tensors, pieces = shard(full_state(seed), 0, 1)
    return save_shards(
        save_dir, tag, group=None, tensors=tensors, pieces=pieces, meta=meta(seed=seed), **kw
    )


@pytest.mark.parametrize(
    "phase, world, kill_rank, second_tag, latest, latest_seed, complete",
    [
        ("shard_written", 2, 1, "b", "a", 0, ["a"]),
        ("manifest_written", 2, 0, "b", "a", 0, ["a"]),
        ("renamed", 1, 0, "b", "a", 0, ["a", "b"]),
        ("latest_written", 1, 0, "b", "b", 1, ["a", "b"]),
        ("moved_aside", 1, 0, "a", "a", 0, []),
    ],
)
def test_sigkill_during_save(
    tmp_path, phase, world, kill_rank, second_tag, latest, latest_seed, complete
):
    save_dir = tmp_path / "ckpt"
    with pytest.raises(RankFailedError) as info:
        run_ranks(
            ranks.save_twice_and_kill,
            world,
            str(save_dir),
            second_tag,
            phase,
            kill_rank,
            timeout=240,  # bounds a hang: the kill must be the failure, even when loaded
        )
    # the harness reports whichever it sees first: the killed rank's signal, or the
    # survivor's gloo error on the connection the dead rank closed
    if info.value.rank == kill_rank:
        assert "signal 9" in str(info.value), str(info.value)

    assert latest_tag(save_dir) == latest
    assert list_tags(save_dir) == complete
    _assert_holds(save_dir, None, latest_seed)
    if phase == "renamed":
        _assert_holds(save_dir, "b", 1)
    if phase == "moved_aside":
        assert not (save_dir / "a").exists() and (save_dir / ".old-a").is_dir()

    # a fresh process saves the same tag again: it settles what the crash left
    _save_local(save_dir, second_tag, 2)
    assert latest_tag(save_dir) == second_tag
    _assert_holds(save_dir, second_tag, 2)
    assert not [e for e in os.listdir(save_dir) if e.startswith(".")], os.listdir(save_dir)


def test_overwrite_and_retention(tmp_path):
    save_dir = tmp_path / "ckpt"
    for step in (8, 9, 10, 11, 12):
        _save_local(save_dir, f"global_step{step}", step, keep_last=2)
    assert list_tags(save_dir) == ["global_step11", "global_step12"]
    (save_dir / "notes").mkdir()  # not a checkpoint: retention never touches it

    # overwrite the latest tag in place
    _save_local(save_dir, "global_step12", 99, keep_last=2)
    _assert_holds(save_dir, None, 99)

    # `latest` pointing at an older tag (a user rolled back) is never deleted
    _save_local(save_dir, "global_step13", 13)
    (save_dir / "latest").write_text("global_step11")
    assert apply_retention(save_dir, 1) == ["global_step12"]
    assert list_tags(save_dir) == ["global_step11", "global_step13"]
    assert sorted(os.listdir(save_dir)) == ["global_step11", "global_step13", "latest", "notes"]

    with pytest.raises(CheckpointError, match="keep_last=0"):
        _save_local(save_dir, "x", 1, keep_last=0)
    with pytest.raises(CheckpointError, match="not a meshtrain checkpoint"):
        _save_local(save_dir, "notes", 1)
    with pytest.raises(CheckpointError, match="not usable as a directory name"):
        _save_local(save_dir, "../escape", 1)
    with pytest.raises(CheckpointError, match="refers to key 'missing'"):
        save_shards(
            save_dir,
            "y",
            group=None,
            tensors={},
            meta=meta(),
            pieces=[Piece("layer.b", "param", "missing", 0, 0, 7)],
        )
    assert latest_tag(save_dir) == "global_step11"
    assert sorted(os.listdir(save_dir)) == ["global_step11", "global_step13", "latest", "notes"]
