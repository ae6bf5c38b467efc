"""The named mesh: coordinates and groups for world sizes 1, 2, 4, 8, every factorisation."""

from __future__ import annotations

import itertools

import pytest

from meshtrain.distributed.topology import MeshLayout
from meshtrain.errors import TopologyError
from tests.harness import run_ranks


def factorisations(n: int) -> list[tuple[int, int, int]]:
    return [(p, d, t) for p, d, t in itertools.product(range(1, n + 1), repeat=3) if p * d * t == n]


def _build_all(world: int):
    """On every rank: build a Topology for every factorisation and report what it sees."""
    import torch
    import torch.distributed as dist

    from meshtrain.distributed import comm
    from meshtrain.distributed.topology import Topology

    seen = []
    for pp, dp, tp in factorisations(world):
        topo = Topology(pp=pp, dp=dp, tp=tp)
        groups = {d: topo.group(d).ranks for d in ("pp", "dp", "tp")}
        # each dimension's group really reduces over exactly those ranks
        sums = {}
        for d in ("pp", "dp", "tp"):
            t = torch.tensor([float(dist.get_rank())])
            comm.all_reduce(t, topo.group(d))
            sums[d] = float(t)
        seen.append(
            dict(
                shape=(pp, dp, tp),
                coords=topo.coords,
                groups=groups,
                sums=sums,
                first=topo.is_first_stage,
                last=topo.is_last_stage,
                prev=topo.prev_stage_rank,
                next=topo.next_stage_rank,
            )
        )
    # two topologies coexist, each with its own books
    a, b = Topology(dp=world), Topology(dp=world)
    comm.all_reduce(torch.ones(10), a.dp_group)
    seen.append((a.stats.total(), b.stats.total()))
    return seen


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_factorisation(world):
    results = run_ranks(_build_all, world, world, timeout=300)
    for rank, seen in enumerate(results):
        *per_shape, books = seen
        expected_books = 2 * 10 * 4 if world > 1 else 0
        assert books == (expected_books, 0)
        assert [s["shape"] for s in per_shape] == factorisations(world)
        for s in per_shape:
            layout = MeshLayout(*s["shape"])
            assert s["coords"] == layout.coords(rank)
            assert layout.rank(**s["coords"]) == rank
            for d in ("pp", "dp", "tp"):
                assert s["groups"][d] == layout.group_ranks(d, rank)
                assert s["sums"][d] == sum(layout.group_ranks(d, rank))
            c = s["coords"]
            assert s["first"] == (c["pp"] == 0)
            assert s["last"] == (c["pp"] == layout.pp - 1)
            assert s["prev"] == (None if c["pp"] == 0 else rank - layout.dp * layout.tp)
            assert s["next"] == (None if s["last"] else rank + layout.dp * layout.tp)


def test_layout_order_is_megatron():
    layout = MeshLayout(pp=2, dp=2, tp=2)
    assert layout.group_ranks("tp", 5) == (4, 5)
    assert layout.group_ranks("dp", 5) == (5, 7)
    assert layout.group_ranks("pp", 5) == (1, 5)
    for dim in ("pp", "dp", "tp"):  # groups partition the world
        flat = sorted(r for g in layout.all_groups(dim) for r in g)
        assert flat == list(range(8))


def test_mismatch_names_all_four_numbers():
    with pytest.raises(TopologyError, match=r"pp 2 x dp 3 x tp 2 = 12 != world size 8"):
        MeshLayout.for_world(8, pp=2, dp=3, tp=2)
    with pytest.raises(TopologyError, match=r"world size 6 is not divisible by pp 4 x tp 1"):
        MeshLayout.for_world(6, pp=4)
    with pytest.raises(TopologyError, match="tp=0"):
        MeshLayout(tp=0)
