"""Properties of DistributedSampler: disjoint, complete, deterministic, resumable, reshardable.

Ranks are simulated in one process: rank r of R is ``DistributedSampler(ds, R, r)``. In
training every rank consumes the same number of samples per step, so "k steps" means each
rank's sampler yields k indices; the state of any rank is then the state of all.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from itertools import islice

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.data import DistributedSampler
from meshtrain.errors import DataError

SETTINGS = settings(max_examples=150, deadline=None)


def ranks(n: int, world: int, **kw) -> list[DistributedSampler]:
    return [DistributedSampler(range(n), num_replicas=world, rank=r, **kw) for r in range(world)]


def consume(samplers: list[DistributedSampler], steps: int | None) -> list[int]:
    """Each rank takes ``steps`` indices (all if None); returns everything taken."""
    taken: list[int] = []
    for s in samplers:
        it = iter(s)
        taken.extend(it if steps is None else islice(it, steps))
    return taken


@SETTINGS
@given(
    n=st.integers(0, 300),
    world=st.integers(1, 8),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_disjoint_complete_equal(n, world, seed, epoch, shuffle, drop_last):
    samplers = ranks(n, world, seed=seed, shuffle=shuffle, drop_last=drop_last)
    per_rank = []
    for s in samplers:
        s.set_epoch(epoch)
        per_rank.append(list(s))
    lengths = {len(p) for p in per_rank}
    assert len(lengths) == 1, "every rank gets an equal share"
    share = lengths.pop()
    assert share == len(samplers[0])
    flat = [i for p in per_rank for i in p]
    counts = Counter(flat)
    if drop_last:
        assert share == n // world
        assert max(counts.values(), default=1) == 1, "disjoint"
        assert len(flat) == n - n % world
    else:
        assert share == math.ceil(n / world)
        assert set(flat) == set(range(n)), "complete"
        pad = share * world - n
        assert pad < world
        assert sum(c - 1 for c in counts.values()) == pad, "only padding repeats"


@SETTINGS
@given(
    n=st.integers(1, 200),
    world=st.integers(1, 6),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 3),
)
def test_matches_torch_and_is_deterministic(n, world, seed, epoch):
    for drop_last in (False, True):
        ours = ranks(n, world, seed=seed, drop_last=drop_last)
        again = ranks(n, world, seed=seed, drop_last=drop_last)
        for r in range(world):
            ref = torch.utils.data.DistributedSampler(
                range(n), num_replicas=world, rank=r, seed=seed, drop_last=drop_last
            )
            ref.set_epoch(epoch)
            ours[r].set_epoch(epoch)
            again[r].set_epoch(epoch)
            assert list(ours[r]) == list(ref) == list(again[r])


def test_epochs_differ_and_state_is_small_json():
    s = DistributedSampler(range(1000), num_replicas=2, rank=0, seed=3)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0
    state = s.state_dict()
    assert all(type(v) is int for v in state.values())
    assert json.loads(json.dumps(state)) == state


@SETTINGS
@given(
    n=st.integers(0, 300),
    world=st.integers(1, 6),
    frac=st.floats(0, 1),
    seed=st.integers(0, 1000),
    drop_last=st.booleans(),
)
def test_resume_continues_with_next_sample(n, world, frac, seed, drop_last):
    full = [list(s) for s in ranks(n, world, seed=seed, drop_last=drop_last)]
    share = len(full[0])
    k = int(frac * share)
    first = ranks(n, world, seed=seed, drop_last=drop_last)
    head = [list(islice(iter(s), k)) for s in first]
    states = [s.state_dict() for s in first]
    assert all(st_ == states[0] for st_ in states), "state is identical on every rank"
    resumed = ranks(n, world, seed=seed + 1, drop_last=drop_last)  # seed comes from the state
    for r, s in enumerate(resumed):
        s.load_state_dict(json.loads(json.dumps(states[0])))
        s.set_epoch(states[0]["epoch"])  # the usual resume order keeps the position
        assert head[r] + list(s) == full[r]


@SETTINGS
@given(
    n=st.integers(0, 400),
    f1=st.floats(0, 1),
    f2=st.floats(0, 1),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
)
def test_reshard_2_3_4_sees_every_sample_once(n, f1, f2, seed, epoch, drop_last):
    seen: list[int] = []
    state = None
    for world, frac in ((2, f1), (3, f2), (4, None)):
        samplers = ranks(n, world, seed=seed, drop_last=drop_last)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(epoch)
        steps = None if frac is None else int(frac * len(samplers[0]))
        seen.extend(consume(samplers, steps))
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)
        assert state["num_replicas"] == world
    counts = Counter(seen)
    if drop_last:
        assert max(counts.values(), default=1) == 1, "nothing repeated"
        assert n - len(counts) < 4, "only the final drop_last tail is left out"
        assert state["consumed"] == len(counts)
    else:
        assert set(counts) == set(range(n)), "nothing skipped"
        assert sum(c - 1 for c in counts.values()) < 4, "repeats only from the final padding"
        assert state["consumed"] == n


def test_reshard_exact_example():
    """10 samples, no shuffle: 2 ranks take 2 steps (positions 0-3), 3 ranks take 1 step
    (4-6), 4 ranks finish (7-9 + 1 pad repeating position 0)."""
    state = None
    got = []
    for world, steps in ((2, 2), (3, 1), (4, None)):
        samplers = ranks(10, world, shuffle=False)
        for s in samplers:
            if state:
                s.load_state_dict(state)
        got.append([list(islice(iter(s), steps)) if steps else list(s) for s in samplers])
        state = samplers[0].state_dict()
    assert got == [[[0, 2], [1, 3]], [[4], [5], [6]], [[7], [8], [9], [0]]]
    assert state["consumed"] == 10


def test_iteration_semantics():
    s = DistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
    assert list(s) == [0, 2, 4, 6, 8]
    assert s.state_dict()["consumed"] == 10
    assert list(s) == [0, 2, 4, 6, 8], "a finished pass repeats the epoch, like torch"
    it = iter(s)
    next(it)
    assert s.state_dict()["consumed"] == 2
    state = s.state_dict()
    t = DistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
    t.load_state_dict(state)
    assert len(t) == 4
    t.set_epoch(0)  # same epoch: position kept
    assert list(t) == [2, 4, 6, 8]
    t.load_state_dict(state)
    t.set_epoch(1)  # new epoch: from the start
    assert list(t) == [0, 2, 4, 6, 8]
    done = dict(state, consumed=10)
    t.load_state_dict(done)
    assert list(t) == [], "a finished epoch restored stays finished"


def test_bad_states_and_arguments():
    s = DistributedSampler(range(10), num_replicas=2, rank=0)
    with pytest.raises(DataError, match="dataset of 10 samples but this dataset has 11"):
        DistributedSampler(range(11), 2, 0).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="missing"):
        s.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="rank must be in"):
        DistributedSampler(range(10), num_replicas=2, rank=2)
    assert DistributedSampler(range(5)).num_replicas == 1  # no process group: world of 1


@SETTINGS
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 5),
    start=st.integers(0, 40),
    batch=st.integers(1, 6),
    shuffle=st.booleans(),
)
def test_exact_rows_order_undeals_every_pass_once(n, world, start, batch, shuffle):
    """Gathering a pass batch by batch (rank-major, with the sampler's padding) and keeping
    ``exact_rows_order`` gives the pass's positions ``P_e[C0:]`` once each, in order; so
    does the whole pass dealt without padding (the Trainer's evaluation)."""
    import numpy as np

    from meshtrain.data.sampler import exact_rows_order

    start = min(start, n)
    samplers = ranks(n, world, shuffle=shuffle, seed=3)
    mine = [s.indices(start) for s in samplers]
    want = samplers[0]._permutation()[start:].tolist()
    got: list[int] = []
    for lo in range(0, len(mine[0]), batch):
        parts = [m[lo : lo + batch] for m in mine]
        gathered = np.concatenate(parts)
        got += gathered[exact_rows_order([len(p) for p in parts], lo, n - start)].tolist()
    assert got == want
    # no padding: rank r holds ceil((M - r) / R) rows, the whole pass gathered at once
    dealt = [np.arange(r, n, world) for r in range(world)]
    order = exact_rows_order([len(d) for d in dealt], 0, n)
    assert np.concatenate(dealt)[order].tolist() == list(range(n))


@pytest.mark.parametrize("n", [1, 3, 17, 48, 50, 64])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_whole_batches_are_the_transformers_trainers_order(n, world, batch, drop_last):
    """deal_batch=B gives each rank what the transformers Trainer's loader gives it
    (accelerate 1.15: SeedableRandomSampler seeded data_seed + epoch, BatchSampler of B,
    BatchSamplerShard with even_batches), index for index, in epochs 0 and 1; on one
    process the short last batch is the loader's to drop, so the sampler keeps it."""
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
    from torch.utils.data import BatchSampler

    for epoch in (0, 1):
        peer, ours = [], []
        for r in range(world):
            seedable = SeedableRandomSampler(range(n), data_seed=7)
            seedable.set_epoch(epoch)
            batches = BatchSampler(seedable, batch, drop_last and world > 1)
            shard = BatchSamplerShard(batches, world, r) if world > 1 else batches
            peer.append([i for b in shard for i in b])
            mine = DistributedSampler(
                range(n), num_replicas=world, rank=r, seed=7, drop_last=drop_last,
                deal_batch=batch,
            )  # fmt: skip
            mine.set_epoch(epoch)
            ours.append(list(mine))
        assert ours == peer


def test_whole_batches_resume_mid_epoch_on_another_world():
    """A pass resumed at k whole global batches deals the rest in whole batches; over
    2 -> 4 ranks every position of the epoch is consumed once (no padding: 48 rows)."""
    first = ranks(48, 2, seed=3, deal_batch=4)
    taken = consume(first, 8)  # two global batches of 2 x 4
    state = first[0].state_dict()
    assert state["consumed"] == 16
    second = ranks(48, 4, seed=3, deal_batch=4)
    for s in second:
        s.load_state_dict(state)
    rest = consume(second, None)
    assert sorted(taken + rest) == list(range(48))
    order = torch.randperm(48, generator=torch.Generator().manual_seed(3)).tolist()
    assert second[1].indices(16)[:4].tolist() == order[20:24]  # rank 1's first batch


def test_deal_batch_below_one_is_refused():
    with pytest.raises(DataError, match="deal_batch must be >= 1"):
        DistributedSampler(range(4), num_replicas=1, rank=0, deal_batch=0)
