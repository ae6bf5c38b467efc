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


# The drawing of docs/architecture.md and of topology.py's docstring, world 8 as
# dp=2 x cp=2 x tp=2 with ep=2: asserted here so the pictures cannot drift.
WORLD8_CP_EP = {
    "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "cp": [(0, 2), (1, 3), (4, 6), (5, 7)],
    "dp": [(0, 4), (1, 5), (2, 6), (3, 7)],
    "dp_cp": [(0, 2, 4, 6), (1, 3, 5, 7)],
    "ep": [(0, 2), (1, 3), (4, 6), (5, 7)],
    "edp": [(0, 4), (1, 5), (2, 6), (3, 7)],
    "pp": [(r,) for r in range(8)],
}


def test_world8_cp_ep_groups_as_drawn():
    layout = MeshLayout(dp=2, cp=2, tp=2, ep=2)
    for dim, groups in WORLD8_CP_EP.items():
        assert sorted(layout.all_groups(dim)) == groups, dim
    assert [layout.coords(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.coords(r)["ep"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.coords(r)["edp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "shape", [(2, 2, 1, 2, 4), (1, 4, 2, 1, 2), (2, 1, 2, 2, 2), (1, 2, 2, 2, 4)]
)
def test_ep_is_carved_out_of_dp_cp(shape):
    """Every ep group lies inside one dp_cp group; ep x edp = dp x cp; every group kind
    partitions the world; a rank's coordinates give back the rank."""
    pp, dp, tp, cp, ep = shape
    layout = MeshLayout(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
    assert layout.size("ep") * layout.size("edp") == dp * cp == layout.size("dp_cp")
    for dim in ("pp", "dp", "cp", "tp", "ep", "edp", "dp_cp"):
        flat = sorted(r for g in layout.all_groups(dim) for r in g)
        assert flat == list(range(layout.world_size)), dim
    for r in range(layout.world_size):
        assert set(layout.group_ranks("ep", r)) <= set(layout.group_ranks("dp_cp", r))
        assert set(layout.group_ranks("edp", r)) <= set(layout.group_ranks("dp_cp", r))
        assert set(layout.group_ranks("ep", r)) & set(layout.group_ranks("edp", r)) == {r}
        assert layout.rank(**layout.coords(r)) == r


def test_ep_must_divide_dp_cp():
    with pytest.raises(TopologyError, match=r"expert parallel size 3 must divide dp 2 x cp 2 = 4"):
        MeshLayout(dp=2, cp=2, ep=3)
    with pytest.raises(TopologyError, match=r"pp 1 x dp 2 x cp 2 x tp 1 = 4 != world size 8"):
        MeshLayout.for_world(8, dp=2, cp=2)


def _cp_ep_groups():
    """On every rank: the new dimensions' groups reduce over exactly their ranks."""
    import torch
    import torch.distributed as dist

    from meshtrain.distributed import comm
    from meshtrain.distributed.topology import GROUPS, Topology

    out = []
    for kw in (dict(cp=2, ep=2), dict(tp=2, ep=2), dict(cp=2, ep=4)):
        topo = Topology(**kw)
        sums = {}
        for d in GROUPS:
            t = torch.tensor([float(dist.get_rank())])
            comm.all_reduce(t, topo.group(d))
            sums[d] = (topo.group(d).ranks, float(t))
        out.append((kw, topo.coords, sums, repr(topo)))
    return out


def test_cp_ep_groups_at_4_ranks():
    for rank, seen in enumerate(run_ranks(_cp_ep_groups, 4, timeout=300)):
        for kw, coords, sums, text in seen:
            layout = MeshLayout.for_world(4, **kw)
            assert coords == layout.coords(rank)
            for d, (ranks, total) in sums.items():
                assert ranks == layout.group_ranks(d, rank), (kw, d)
                assert total == sum(ranks), (kw, d)
            assert f"cp={layout.cp}" in text and f"ep={layout.ep}" in text
