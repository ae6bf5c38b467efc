"""The named device mesh: pipeline x data x tensor parallel (pp x dp x tp).

Ranks are laid out row-major over ``(pp, dp, tp)``::

    rank = (pp_index * dp + dp_index) * tp + tp_index

so tensor-parallel peers are adjacent ranks (the same node: tp traffic is per layer and
heaviest), data-parallel peers are ``tp`` apart, and pipeline stages are ``dp * tp``
apart (stage-to-stage traffic is the lightest, fine across nodes). This is Megatron-LM's
order. ``MeshLayout`` is that arithmetic alone, usable without processes (checkpoint
resharding, tests); ``Topology`` builds torch's ``DeviceMesh`` on top of it and hands out
one ``Group`` per dimension, each recording bytes into this topology's ``CommStats``.

A ``Topology`` is always passed explicitly; several can live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.distributed.comm import CommStats, Group
from meshtrain.errors import TopologyError

DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the three mesh dimensions and the rank <-> coordinate arithmetic."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise TopologyError(f"mesh size {name}={size!r} must be a positive integer")

    @classmethod
    def for_world(
        cls, world_size: int, pp: int = 1, dp: int | None = None, tp: int = 1
    ) -> MeshLayout:
        """The layout for ``world_size`` ranks; ``dp`` defaults to what is left over."""
        if dp is None:
            if world_size % (pp * tp):
                raise TopologyError(
                    f"world size {world_size} is not divisible by pp {pp} x tp {tp} = "
                    f"{pp * tp}; pick pipeline/tensor sizes that divide the world size"
                )
            dp = world_size // (pp * tp)
        layout = cls(pp=pp, dp=dp, tp=tp)
        if layout.world_size != world_size:
            raise TopologyError(
                f"pp {pp} x dp {dp} x tp {tp} = {layout.world_size} != world size "
                f"{world_size}; the three mesh sizes must multiply to the number of processes"
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside a world of {self.world_size}")
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": rank // self.tp % self.dp,
            "tp": rank % self.tp,
        }

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, dim: str, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s group along ``dim``, in group-rank order."""
        if dim not in DIMS:
            raise TopologyError(f"unknown mesh dimension {dim!r}; use one of {DIMS}")
        c = self.coords(rank)
        out = []
        for i in range(getattr(self, dim)):
            c[dim] = i
            out.append(self.rank(**c))
        return tuple(out)

    def all_groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every group along ``dim`` (each rank appears in exactly one)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group_ranks(dim, r))
        return list(seen)


class Topology:
    """This process's view of the mesh: coordinates, groups, pipeline neighbours, stats.

    Needs the default process group (``meshtrain.init_distributed()``). Every rank of the
    world must construct it together (it creates process groups).
    """

    def __init__(
        self,
        pp: int = 1,
        dp: int | None = None,
        tp: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise TopologyError(
                "Topology needs a process group; call meshtrain.init_distributed() first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = MeshLayout.for_world(world, pp=pp, dp=dp, tp=tp)
        self.rank = rank
        self.coords = self.layout.coords(rank)
        if device is None:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stats = CommStats()
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, self.layout.shape, mesh_dim_names=DIMS)
        self._groups: dict[str, Group] = {}
        for dim in DIMS:
            pg = self.mesh.get_group(dim)
            ranks = tuple(dist.get_process_group_ranks(pg))
            expected = self.layout.group_ranks(dim, rank)
            if ranks != expected:  # our arithmetic and DeviceMesh must agree
                raise TopologyError(f"{dim} group {ranks} != expected {expected}")
            self._groups[dim] = Group(dim, pg, ranks, ranks.index(rank), self.stats)
        self._groups["world"] = Group(
            "world", dist.group.WORLD, tuple(range(world)), rank, self.stats
        )

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
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    # groups ------------------------------------------------------------------------------
    def group(self, dim: str) -> Group:
        """The ``Group`` of this rank along ``dim`` ("pp", "dp", "tp" or "world")."""
        try:
            return self._groups[dim]
        except KeyError:
            raise TopologyError(
                f"unknown mesh dimension {dim!r}; use pp, dp, tp or world"
            ) from None

    @property
    def dp_group(self) -> Group:
        return self._groups["dp"]

    @property
    def tp_group(self) -> Group:
        return self._groups["tp"]

    @property
    def pp_group(self) -> Group:
        return self._groups["pp"]

    # pipeline ----------------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same dp, tp), None on the first."""
        if self.is_first_stage:
            return None
        return self.layout.rank(self.pp_rank - 1, self.dp_rank, self.tp_rank)

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the next pipeline stage (same dp, tp), None on the last."""
        if self.is_last_stage:
            return None
        return self.layout.rank(self.pp_rank + 1, self.dp_rank, self.tp_rank)

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"Topology(pp={self.pp_size}, dp={self.dp_size}, tp={self.tp_size}; rank "
            f"{self.rank} at pp={c['pp']} dp={c['dp']} tp={c['tp']}, {self.device})"
        )
