"""The named device mesh: pipeline x data x context x tensor (pp x dp x cp x tp), with
expert parallelism (ep) carved out of dp x cp. Every group and coordinate is derived here.

Ranks are laid out row-major over ``(pp, dp, cp, tp)``::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so tensor-parallel peers are adjacent ranks (the same node: tp traffic is per layer and
heaviest), context-parallel peers are ``tp`` apart (ring attention passes keys and values
every layer, next heaviest), data-parallel peers are ``cp * tp`` apart, and pipeline
stages are ``dp * cp * tp`` apart (stage-to-stage traffic is the lightest, fine across
nodes). This is Megatron-LM's order (``tp-cp-ep-dp-pp``, innermost first) and
torchtitan's (``pp, dp, cp, tp``).

Expert parallelism adds no ranks. The ``dp x cp`` ranks of one ``(pp, tp)`` coordinate
all hold the same non-expert weights (their gradients are averaged over the ``dp_cp``
group); numbered ``f = dp_index * cp + cp_index``, consecutive blocks of ``ep`` of them
form an ``ep`` group that splits the experts between its members (token all-to-all), and
the ranks holding the same expert slice form that slice's expert-data-parallel group
``edp`` (size ``dp * cp / ep``, over which expert gradients are averaged)::

    ep_index = f % ep        edp_index = f // ep

World 8 as dp=2 x cp=2 x tp=2 with ep=2 (pp=1); docs/architecture.md has more::

    rank:  0 1 2 3 4 5 6 7      tp groups:    (0,1) (2,3) (4,5) (6,7)
    dp:    0 0 0 0 1 1 1 1      cp groups:    (0,2) (1,3) (4,6) (5,7)
    cp:    0 0 1 1 0 0 1 1      dp groups:    (0,4) (1,5) (2,6) (3,7)
    tp:    0 1 0 1 0 1 0 1      dp_cp groups: (0,2,4,6) (1,3,5,7)
    ep:    0 0 1 1 0 0 1 1      ep groups:    (0,2) (1,3) (4,6) (5,7)   ep borrows cp first
    edp:   0 0 0 0 1 1 1 1      edp groups:   (0,4) (1,5) (2,6) (3,7)

``MeshLayout`` is that arithmetic alone, usable without processes (checkpoint resharding,
tests); ``Topology`` builds torch's ``DeviceMesh`` on top of it and hands out one
``Group`` per dimension, each recording bytes into this topology's ``CommStats``.
A ``Topology`` is always passed explicitly; several can live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.distributed.comm import CommStats, Group, host_staging_from_env, stages_on_host
from meshtrain.errors import TopologyError

MESH_DIMS = ("pp", "dp", "cp", "tp")  # the rank order, outermost first
GROUPS = (*MESH_DIMS, "ep", "edp", "dp_cp")  # every group a rank belongs to (plus "world")


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the mesh dimensions and the rank <-> coordinate arithmetic.

    The fields keep their historical positional order ``(pp, dp, tp, cp, ep)``; the rank
    order is ``MESH_DIMS``.
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "cp", "tp", "ep"):
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise TopologyError(f"mesh size {name}={size!r} must be a positive integer")
        if (self.dp * self.cp) % self.ep:
            raise TopologyError(
                f"expert parallel size {self.ep} must divide dp {self.dp} x cp {self.cp} = "
                f"{self.dp * self.cp}: expert parallelism is carved out of the data and "
                "context ranks; pick an ep that divides dp x cp"
            )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        pp: int = 1,
        dp: int | None = None,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> MeshLayout:
        """The layout for ``world_size`` ranks; ``dp`` defaults to what is left over."""
        with_cp = f" x cp {cp}" if cp > 1 else ""  # the message names cp when it is used
        if dp is None:
            if world_size % (pp * cp * tp):
                raise TopologyError(
                    f"world size {world_size} is not divisible by pp {pp}{with_cp} x tp {tp} "
                    f"= {pp * cp * tp}; pick pipeline/{'context/' if cp > 1 else ''}tensor "
                    "sizes that divide the world size"
                )
            dp = world_size // (pp * cp * tp)
        layout = cls(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
        if layout.world_size != world_size:
            raise TopologyError(
                f"pp {pp} x dp {dp}{with_cp} x tp {tp} = {layout.world_size} != world size "
                f"{world_size}; the mesh sizes must multiply to the number of processes"
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes along ``MESH_DIMS``."""
        return (self.pp, self.dp, self.cp, self.tp)

    def size(self, group: str) -> int:
        """Size of a group named in ``GROUPS`` (or "world")."""
        derived = {"edp": self.dp * self.cp // self.ep, "dp_cp": self.dp * self.cp}
        if group == "world":
            return self.world_size
        if group in derived:
            return derived[group]
        if group not in GROUPS:
            raise TopologyError(f"unknown mesh group {group!r}; use one of {GROUPS} or world")
        return getattr(self, group)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp", "dp", "cp", "tp", "ep", "edp"}`` indices of a global rank."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside a world of {self.world_size}")
        c = {
            "pp": rank // (self.dp * self.cp * self.tp),
            "dp": rank // (self.cp * self.tp) % self.dp,
            "cp": rank // self.tp % self.cp,
            "tp": rank % self.tp,
        }
        f = c["dp"] * self.cp + c["cp"]  # place in the dp x cp plane
        return {**c, "ep": f % self.ep, "edp": f // self.ep}

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0, **derived: int) -> int:
        """The global rank at a mesh coordinate (``ep``/``edp`` follow from dp and cp)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def _plane_rank(self, c: dict[str, int], f: int) -> int:
        """The rank at place ``f`` of the dp x cp plane, with ``c``'s pp and tp."""
        return self.rank(pp=c["pp"], dp=f // self.cp, cp=f % self.cp, tp=c["tp"])

    def group_ranks(self, dim: str, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s group along ``dim`` (one of ``GROUPS`` or "world"),
        in group-rank order."""
        size = self.size(dim)  # also rejects an unknown name
        c = self.coords(rank)
        if dim == "world":
            return tuple(range(self.world_size))
        if dim in MESH_DIMS:
            return tuple(self.rank(**{**_mesh(c), dim: i}) for i in range(size))
        if dim == "dp_cp":
            fs = range(size)
        elif dim == "ep":
            fs = range(c["edp"] * self.ep, (c["edp"] + 1) * self.ep)
        else:  # edp
            fs = range(c["ep"], self.dp * self.cp, self.ep)
        return tuple(self._plane_rank(c, f) for f in fs)

    def all_groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every group along ``dim`` (each rank appears in exactly one)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group_ranks(dim, r))
        return list(seen)


def _mesh(c: dict[str, int]) -> dict[str, int]:
    return {d: c[d] for d in MESH_DIMS}


class Topology:
    """This process's view of the mesh: coordinates, groups, pipeline neighbours, stats.

    Needs the default process group (``meshtrain.init_distributed()``). Every rank of the
    world must construct it together (it creates process groups). ``mesh`` is torch's
    ``DeviceMesh`` over pp, dp, (cp when > 1) and tp: a dimension of size 1 other than
    those three would only cost ``world`` extra process groups at start. Groups of one
    rank that are in no DeviceMesh (cp, ep, edp at size 1) have ``pg=None``; collectives
    on them do nothing, as on every size-1 group.
    """

    def __init__(
        self,
        pp: int = 1,
        dp: int | None = None,
        tp: int = 1,
        device: torch.device | str | None = None,
        *,
        cp: int = 1,
        ep: int = 1,
    ) -> None:
        if not dist.is_initialized():
            raise TopologyError(
                "Topology needs a process group; call meshtrain.init_distributed() first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = layout = MeshLayout.for_world(world, pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
        self.rank = rank
        self.coords = layout.coords(rank)
        if device is None:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stats = CommStats()
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(d for d in MESH_DIMS if d != "cp" or layout.cp > 1)
        shape = tuple(layout.size(d) for d in names)
        # gloo with CUDA tensors (ranks sharing a GPU): the groups are host groups, and
        # comm stages CUDA tensors through host memory; the mesh is built as a CPU one
        mesh_device = "cpu" if stages_on_host(dist.get_backend(), self.device.type) else None
        self.mesh = init_device_mesh(mesh_device or self.device.type, shape, mesh_dim_names=names)
        self._groups: dict[str, Group] = {}
        self.host_staging = host_staging_from_env()  # comm's Group.host_staging
        for dim in GROUPS:  # the same order on every rank: new_group is collective
            expected = layout.group_ranks(dim, rank)
            if dim in names:
                pg = self.mesh.get_group(dim)
                ranks = tuple(dist.get_process_group_ranks(pg))
                if ranks != expected:  # our arithmetic and DeviceMesh must agree
                    raise TopologyError(f"{dim} group {ranks} != expected {expected}")
            elif len(expected) == 1:
                pg = None
            else:
                # ep runs the token all-to-all inside forward and backward, interleaved
                # with the gradient reductions autograd hooks launch on dp: a process
                # group of its own keeps the two sequences of collectives apart (on one
                # shared group, routing-dependent backward order would mismatch them)
                same = None if dim == "ep" else self._same_as(expected)
                pg = same or _new_groups(layout, dim, rank)
            self._groups[dim] = Group(
                dim, pg, expected, expected.index(rank), self.stats, self.host_staging
            )
        self._groups["world"] = Group(
            "world", dist.group.WORLD, tuple(range(world)), rank, self.stats, self.host_staging
        )

    def _same_as(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of an already built group with exactly these ranks: dp_cp is
        dp when cp is 1, edp is dp_cp when ep is 1 (no second group for the same ranks).
        Equal sizes on every rank, so every rank takes the same branch."""
        for g in self._groups.values():
            if g.ranks == ranks and g.pg is not None:
                return g.pg
        return None

    # sizes and coordinates -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def ep_rank(self) -> int:
        return self.coords["ep"]

    # groups ------------------------------------------------------------------------------
    def group(self, dim: str) -> Group:
        """The ``Group`` of this rank along ``dim``: one of ``GROUPS`` or "world"."""
        try:
            return self._groups[dim]
        except KeyError:
            raise TopologyError(
                f"unknown mesh dimension {dim!r}; use one of {', '.join(GROUPS)} or world"
            ) from None

    @property
    def dp_group(self) -> Group:
        return self._groups["dp"]

    @property
    def replica_group(self) -> Group:
        """The ranks holding the same copy of the (non-expert) weights, over which their
        gradients are averaged and ZeRO shards: dp x cp. It is the ``dp`` group itself when
        cp is 1 (the same ranks; the ledger and the step log then say ``dp``)."""
        return self._groups["dp" if self.cp_size == 1 else "dp_cp"]

    @property
    def cp_group(self) -> Group:
        return self._groups["cp"]

    @property
    def tp_group(self) -> Group:
        return self._groups["tp"]

    @property
    def pp_group(self) -> Group:
        return self._groups["pp"]

    @property
    def ep_group(self) -> Group:
        return self._groups["ep"]

    # pipeline ----------------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same dp, cp, tp), None on the first."""
        if self.is_first_stage:
            return None
        return self.layout.rank(**{**_mesh(self.coords), "pp": self.pp_rank - 1})

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the next pipeline stage (same dp, cp, tp), None on the last."""
        if self.is_last_stage:
            return None
        return self.layout.rank(**{**_mesh(self.coords), "pp": self.pp_rank + 1})

    def __repr__(self) -> str:
        c = self.coords
        sizes = ", ".join(f"{d}={self.layout.size(d)}" for d in (*MESH_DIMS, "ep"))
        where = " ".join(f"{d}={c[d]}" for d in (*MESH_DIMS, "ep"))
        return f"Topology({sizes}; rank {self.rank} at {where}, {self.device})"


def _new_groups(layout: MeshLayout, dim: str, rank: int) -> dist.ProcessGroup:
    """Create every group along ``dim`` (``new_group`` is collective over the world, in
    the same order on every rank) and return this rank's."""
    mine = None
    for ranks in layout.all_groups(dim):
        pg = dist.new_group(list(ranks))
        if rank in ranks:
            mine = pg
    return mine
