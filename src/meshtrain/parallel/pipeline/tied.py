"""Parameters that pipeline stages on different ranks share (GPT-2's tied input embedding
and LM head): which ranks hold each, and a process group per tied parameter over those
ranks, so the pipeline can sum its gradient there (one all-reduce of the parameter's size
per step, over the holders only)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def tied_parameters(
    stages: Sequence[nn.Module], p: int, rank_of=None
) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the ranks (stage ``k`` on rank ``rank_of(k)``, default ``k % p``)
    of every parameter that stages on more than one rank hold. ``stages`` are all stages,
    with ``names`` dicts."""
    rank_of = rank_of or (lambda k: k % p)
    holders: dict[str, set[int]] = {}
    for k, stage in enumerate(stages):
        for name in stage.names:
            holders.setdefault(name, set()).add(rank_of(k))
    return {n: tuple(sorted(r)) for n, r in holders.items() if len(r) > 1}


def tied_groups(
    stages: Sequence[nn.Module], topology, rank_of=None
) -> list[tuple[nn.Parameter, object]]:
    """``(parameter, comm.Group)`` for every tied parameter of a split model this rank
    holds (see ``make_tied_groups``); ``stages`` are all stages, with ``names`` dicts;
    ``rank_of(k)`` the pp rank of stage ``k`` (default ``k % pp``; a V for zbv)."""
    p = topology.pp_size
    rank_of = rank_of or (lambda k: k % p)
    mine: dict[str, nn.Parameter] = {}
    for k, stage in enumerate(stages):
        if rank_of(k) == topology.pp_rank:
            mine.update(stage.names)
    return make_tied_groups(tied_parameters(stages, p, rank_of), mine, topology)


def make_tied_groups(holders: dict, mine: dict, topology) -> list[tuple[nn.Parameter, object]]:
    """``(parameter, comm.Group)`` per tied name this rank holds, the group being the ranks
    of its pp group listed in ``holders[name]`` (pp ranks). Collective: every rank of the
    world calls it (``new_group`` for each pp group of the mesh, in one order everywhere)."""
    import torch.distributed as dist

    from meshtrain.distributed.comm import Group

    out = []
    for name, pp_holders in sorted(holders.items()):
        for pp_ranks in topology.layout.all_groups("pp"):
            ranks = tuple(pp_ranks[h] for h in pp_holders)
            pg = dist.new_group(list(ranks))
            if topology.rank in ranks:
                group = Group(
                    "pp_tied", pg, ranks, ranks.index(topology.rank), topology.stats,
                    getattr(topology, "host_staging", None),
                )  # fmt: skip
                out.append((mine[name], group))
    return out
