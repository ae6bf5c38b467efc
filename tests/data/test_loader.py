"""ResumableDataLoader: the saved position is what training consumed, not what workers
prefetched; resuming (also under another replica count) continues the same global order."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice

import torch
from torch.utils.data import Dataset

from meshtrain.data import DistributedSampler, PaddingCollator, ResumableDataLoader


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loaders(n: int, world: int, batch_size: int, **kw) -> list[ResumableDataLoader]:
    return [
        ResumableDataLoader(Indices(n), batch_size, num_replicas=world, rank=r, seed=7, **kw)
        for r in range(world)
    ]


def flat(batches) -> list[int]:
    return [int(i) for b in batches for i in b]


def test_prefetching_does_not_move_the_position():
    loader = ResumableDataLoader(
        Indices(1000), 4, num_replicas=2, rank=0, num_workers=2, prefetch_factor=4
    )
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    sampler = loader.sampler
    # workers have pulled (2 workers x 4 batches) ahead, but 3 batches reached training
    assert sampler._local == 12
    assert loader.state_dict()["consumed"] == 3 * 4 * 2
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = ResumableDataLoader(Indices(1000), 4, num_replicas=2, rank=0, num_workers=2)
    resumed.load_state_dict(state)
    remaining = len(resumed)
    rest = list(resumed)
    full = list(ResumableDataLoader(Indices(1000), 4, num_replicas=2, rank=0))
    assert flat(head) + flat(rest) == flat(full)
    assert remaining == len(full) - 3 == len(rest)


def test_reshard_through_loaders_mid_epoch():
    n, seen, state = 103, [], None
    for world, steps in ((2, 5), (3, 4), (4, None)):
        group = loaders(n, world, batch_size=3, num_workers=0)
        for loader in group:
            if state is not None:
                loader.load_state_dict(state)
            loader.set_epoch(2)
        for loader in group:
            seen.extend(flat(loader if steps is None else islice(iter(loader), steps)))
        state = group[0].state_dict()
        assert all(loader.state_dict() == state for loader in group)
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    assert sum(c - 1 for c in counts.values()) < 4


def test_epoch_end_checkpoint_resumes_into_next_epoch():
    loader = ResumableDataLoader(Indices(10), 2, num_replicas=1, rank=0, shuffle=False)
    assert flat(loader) == list(range(10))
    state = loader.state_dict()
    assert state["consumed"] == 10
    again = ResumableDataLoader(Indices(10), 2, num_replicas=1, rank=0, shuffle=False)
    again.load_state_dict(state)
    again.set_epoch(0)
    assert flat(again) == [], "epoch 0 was finished before the checkpoint"
    again.set_epoch(1)
    assert flat(again) == list(range(10))


def test_hf_dataset_and_collator():
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]], "label": [0, 1, 0]})
    loader = ResumableDataLoader(
        ds, 3, num_replicas=1, rank=0, shuffle=False, collate_fn=PaddingCollator(pad_token_id=0)
    )
    (batch,) = list(loader)
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]))
    assert torch.equal(batch["labels"], torch.tensor([0, 1, 0]))
    assert loader.state_dict()["consumed"] == 3


def test_given_sampler_is_used():
    sampler = DistributedSampler(Indices(8), num_replicas=2, rank=1, shuffle=False)
    loader = ResumableDataLoader(Indices(8), 2, sampler=sampler)
    assert flat(loader) == [1, 3, 5, 7]
    assert sampler.state_dict()["consumed"] == 8
