"""accelerate's batch dealing as a resumable sampler (``accelerate/batch_shard.py``),
without processes: the per-rank indices are pure arithmetic on ``(N, B, R, r)``.

Checked against accelerate's own ``BatchSamplerShard`` (imported when installed) over a
grid of sizes, with and without ``drop_last``; then the invariants meshtrain adds: a pass
resumed after ``k`` global steps deals the rest of the same order (also under another
number of ranks), and ``rows_kept`` keeps exactly the real rows of each global batch.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from torch.utils.data import BatchSampler, SequentialSampler

from meshtrain.accelerate.batch_shard import BatchShardSampler, rows_kept
from meshtrain.accelerate.engine_config import dataloader_options
from meshtrain.errors import ConfigError


def _ours(n, bs, world, rank, drop_last=False, shuffle=False, seed=0):
    s = BatchShardSampler(
        range(n),
        bs,
        num_replicas=world,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return s.indices(0).tolist()


@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_accelerates_batch_sampler_shard(drop_last):
    accelerate = pytest.importorskip("accelerate.data_loader")
    for n, bs, world in itertools.product((1, 3, 7, 8, 21, 32), (1, 2, 4), (1, 2, 3)):
        for rank in range(world):
            shard = accelerate.BatchSamplerShard(
                BatchSampler(SequentialSampler(range(n)), bs, drop_last),
                num_processes=world,
                process_index=rank,
            )
            want = [i for batch in shard for i in batch]
            assert _ours(n, bs, world, rank, drop_last) == want, (n, bs, world, rank)


def test_resume_and_reshard_continue_the_same_order():
    n, bs = 29, 3
    full = BatchShardSampler(
        range(n), bs, num_replicas=2, rank=0, shuffle=True, seed=5, drop_last=False
    )
    order = full._permutation()
    for world_after in (1, 2, 3):
        first = BatchShardSampler(
            range(n), bs, num_replicas=2, rank=0, shuffle=True, seed=5, drop_last=False
        )
        iter(first)
        first.advance(2 * bs)  # two global steps of 2 x 3 rows consumed
        state = first.state_dict()
        assert state["consumed"] == 12
        rest = []
        for rank in range(world_after):
            s = BatchShardSampler(
                range(n),
                bs,
                num_replicas=world_after,
                rank=rank,
                shuffle=False,
                seed=0,
                drop_last=False,
            )
            s.load_state_dict(state)  # adopts seed and shuffle: the same order
            rest.append(s.indices().reshape(-1, bs).tolist())
        # rank-major per global step, the real rows are the order's positions 12..28
        steps = len(rest[0])
        dealt = [i for k in range(steps) for r in range(world_after) for i in rest[r][k]]
        assert dealt[: n - 12] == order[12:].tolist(), world_after


def test_rows_kept_is_accelerates_remainder():
    # 21 rows, batch 4, 2 ranks: global steps of 8; the last holds 5 real rows
    assert [rows_kept(s, 4, 2, 21, 4) for s in (0, 4, 8)] == [8, 8, 5]
    assert rows_kept(0, 4, 2, 3, 4) == 3  # fewer rows than one global batch


def test_dataloader_config_options_are_read_or_refused_by_name():
    assert dataloader_options(None) is False
    assert dataloader_options(SimpleNamespace(split_batches=True)) is True
    for name, value in (
        ("dispatch_batches", True),
        ("even_batches", False),
        ("use_seedable_sampler", True),
        ("data_seed", 3),
    ):
        with pytest.raises(ConfigError, match=name):
            dataloader_options(SimpleNamespace(**{name: value}))
