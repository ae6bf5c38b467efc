"""Collectives and point-to-point transfers that count their bytes.

Every function takes the ``Group`` it runs on explicitly (there is no default group) and
records what it moved into that group's ``CommStats``, which belongs to the ``Topology``
that made the group. Two topologies in one process therefore keep separate books.

How bytes are counted (per rank, per call; ``b`` = element size x element count):

==================  =====================================  =========================
op                  recorded bytes                         in the ZeRO paper's units
==================  =====================================  =========================
all_reduce          2 x b of the tensor reduced            2 Psi for a gradient
                                                           all-reduce of Psi bytes
reduce_scatter      b of the full (input) tensor           Psi
all_gather          b of the full (output) tensor          Psi
broadcast           b of the tensor                        --
send / recv         b of the tensor, on the sender as      --
                    ``send`` and on the receiver as
                    ``recv``
==================  =====================================  =========================

This is the *communication volume* convention of the ZeRO paper (Rajbhandari et al.,
2020, section 7): an all-reduce is a reduce-scatter followed by an all-gather, each moving
the whole buffer's worth once, so data parallelism moves 2 Psi per step, ZeRO stages 1/2
move Psi (reduce-scatter of gradients) + Psi (all-gather of parameters) = 2 Psi, and
ZeRO-3 moves 3 Psi (two parameter all-gathers and one gradient reduce-scatter). The bytes
a ring implementation actually puts on each rank's wire are the recorded bytes times
``(n - 1) / n`` for a group of ``n``; ``CommStats.wire_bytes`` applies that factor.
Collectives on a group of size 1 move nothing and record nothing.

``label`` separates traffic that is not part of the model-state volume (e.g. the scalar
all-reduce of a gradient norm, recorded under ``"control"``) so theory checks can be exact.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtrain.distributed.ledger import Ledger

ReduceOp = dist.ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommStats:
    """Bytes and call counts by (op, group name), owned by one ``Topology``.

    Thread-safe: gradient hooks may record from autograd's worker threads on GPU. Also holds
    the topology's collective ``ledger`` (:mod:`meshtrain.distributed.ledger`), which the
    hang doctor reads; it does not take part in the byte accounting.
    """

    def __init__(self) -> None:
        self.ledger = Ledger()
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self._wire: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, op: str, group: str, nbytes: int, group_size: int) -> None:
        with self._lock:
            key = (op, group)
            self._bytes[key] += nbytes
            self._calls[key] += 1
            # send/recv/broadcast move the whole payload; collectives the ring fraction
            factor = 1.0 if op in ("send", "recv", "broadcast") else (group_size - 1) / group_size
            self._wire[key] += nbytes * factor

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of bytes by (op, group) so far; subtract two with ``diff``."""
        with self._lock:
            return dict(self._bytes)

    @staticmethod
    def diff(after: dict, before: dict) -> dict[tuple[str, str], int]:
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}

    def total(self, *, op: str | None = None, group: str | None = None) -> int:
        """Recorded bytes, optionally only one op kind and/or one group name."""
        with self._lock:
            return sum(
                v
                for (o, g), v in self._bytes.items()
                if (op is None or o == op) and (group is None or g == group)
            )

    def calls(self, *, op: str | None = None, group: str | None = None) -> int:
        with self._lock:
            return sum(
                v
                for (o, g), v in self._calls.items()
                if (op is None or o == op) and (group is None or g == group)
            )

    def wire_bytes(self) -> float:
        """Bytes a ring implementation sends per rank: recorded x (n-1)/n for collectives."""
        with self._lock:
            return sum(self._wire.values())

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (o, _g), v in self.snapshot().items():
            out[o] += v
        return dict(out)

    def by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_o, g), v in self.snapshot().items():
            out[g] += v
        return dict(out)

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._calls.clear()
            self._wire.clear()


@dataclass(frozen=True, eq=False)
class Group:
    """A process group together with its mesh name, this rank's place and its books."""

    name: str  # "pp", "dp", "tp", "world", ...
    pg: dist.ProcessGroup | None = field(repr=False)
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this process's rank inside the group
    stats: CommStats = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(group: Group, op: str, nbytes: int, label: str | None) -> None:
    group.stats.record(op if label is None else label, group.name, nbytes, group.size)


def all_reduce(
    tensor: torch.Tensor,
    group: Group,
    op: dist.ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    label: str | None = None,
):
    """In-place all-reduce; records 2 x bytes (see module docstring)."""
    if group.size == 1:
        return _Done() if async_op else None
    _record(group, "all_reduce", 2 * _nbytes(tensor), label)
    return _call(
        group, "all_reduce", (tensor,), async_op,
        dist.all_reduce, tensor, op=op, group=group.pg, async_op=async_op,
    )  # fmt: skip


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    op: dist.ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    label: str | None = None,
):
    """``output`` (numel n) receives this rank's reduced chunk of ``input`` (numel n x size).

    Records the bytes of ``input``.
    """
    if input.numel() != output.numel() * group.size:
        raise ValueError(
            f"reduce_scatter over {group.name} (size {group.size}): input has "
            f"{input.numel()} elements, expected output {output.numel()} x {group.size}"
        )
    if group.size == 1:
        output.copy_(input)
        return _Done() if async_op else None
    _record(group, "reduce_scatter", _nbytes(input), label)
    return _call(
        group, "reduce_scatter", (input,), async_op,
        _reduce_scatter_single, output, input, op=op, group=group.pg, async_op=async_op,
    )  # fmt: skip


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    async_op: bool = False,
    label: str | None = None,
):
    """``output`` (numel n x size) receives every rank's ``input`` in group-rank order.

    Records the bytes of ``output``.
    """
    if output.numel() != input.numel() * group.size:
        raise ValueError(
            f"all_gather over {group.name} (size {group.size}): output has "
            f"{output.numel()} elements, expected input {input.numel()} x {group.size}"
        )
    if group.size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done() if async_op else None
    _record(group, "all_gather", _nbytes(output), label)
    return _call(
        group, "all_gather", (output,), async_op,
        _all_gather_single, output, input, group=group.pg, async_op=async_op,
    )  # fmt: skip


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Group,
    async_op: bool = False,
    label: str | None = None,
):
    """Broadcast from group rank ``src``; records the tensor's bytes."""
    if group.size == 1:
        return _Done() if async_op else None
    _record(group, "broadcast", _nbytes(tensor), label)
    return _call(
        group, "broadcast", (tensor,), async_op,
        dist.broadcast, tensor, src=group.global_rank(src), group=group.pg, async_op=async_op,
    )  # fmt: skip


def send(tensor: torch.Tensor, dst: int, group: Group, label: str | None = None) -> None:
    """Blocking send to group rank ``dst``."""
    _record(group, "send", _nbytes(tensor), label)
    _call(group, "send", (tensor,), False, dist.send, tensor, group.global_rank(dst), group.pg)


def recv(tensor: torch.Tensor, src: int, group: Group, label: str | None = None) -> None:
    """Blocking receive from group rank ``src``."""
    _record(group, "recv", _nbytes(tensor), label)
    _call(group, "recv", (tensor,), False, dist.recv, tensor, group.global_rank(src), group.pg)


def batch_p2p(
    group: Group,
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
    label: str | None = None,
) -> list:
    """Post sends and receives (``(tensor, group_rank)`` pairs) together; return the works.

    Batching lets a pipeline stage exchange activations with both neighbours without the
    ordering deadlocks of blocking send/recv. Wait on every returned work.
    """
    ops = []
    for tensor, peer in sends:
        _record(group, "send", _nbytes(tensor), label)
        ops.append(dist.P2POp(dist.isend, tensor, group.global_rank(peer), group.pg))
    for tensor, peer in recvs:
        _record(group, "recv", _nbytes(tensor), label)
        ops.append(dist.P2POp(dist.irecv, tensor, group.global_rank(peer), group.pg))
    if not ops:
        return []
    led = group.stats.ledger
    if not led.enabled:
        return dist.batch_isend_irecv(ops)
    tensors = [t for t, _ in sends] + [t for t, _ in recvs]
    seq = led.enter(group, "batch_p2p", tuple(tensors), 2)
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as exc:
        led.failed(group, seq, exc)
        raise
    return [led.track(w, group, seq) for w in works]


def _call(g: Group, name: str, tensors: tuple, is_async: bool, fn, /, *args, **kwargs):
    """Run torch's collective ``fn`` with a ledger entry around it (see ledger.py).

    A sync call is marked done when it returns; an async one when its work's ``wait()``
    returns. An exception publishes this rank's ledger before it propagates.
    """
    led = g.stats.ledger
    if not led.enabled:
        return fn(*args, **kwargs)
    seq = led.enter(g, name, tensors)
    try:
        work = fn(*args, **kwargs)
    except Exception as exc:
        led.failed(g, seq, exc)
        raise
    if is_async:
        return led.track(work, g, seq)
    led.done(g, seq)
    return work


class _Done:
    """The async handle of a collective that had nothing to do (group of size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
