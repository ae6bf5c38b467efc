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
all_to_all          b of the input (= the output) tensor   --
broadcast           b of the tensor                        --
all_to_all          b of the input (what this rank sends,  --
                    its own chunk included)
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

ZeRO's buckets: the cheaper primitive per backend
-------------------------------------------------
``reduce_scatter_bucket`` and ``all_gather_bucket`` are the two collectives ZeRO runs over a
flat bucket of ``n`` elements split into ``N`` chunks (one per data-parallel rank). On CUDA
(NCCL) they are the native ``reduce_scatter_tensor`` / ``all_gather_into_tensor``. On CPU
(gloo) the native ones are the slow way: gloo's reduce-scatter clones the input, all-reduces
the clone and copies the chunk out; its all-gather goes through a full-size temporary.
Measured on the 2-core machine, 2 ranks, 7 buckets of 38 MiB (wall / process CPU ms):

==============  ===========  ==============================================================
operation       native       used on CPU instead
==============  ===========  ==============================================================
reduce-scatter  279 / 259    in-place ``all_reduce`` of the whole bucket: 150 / 115
all-gather      234 / 199    each rank ``broadcast``\\s its own chunk in place: 75 / 52
==============  ===========  ==============================================================

The CPU reduce-scatter leaves the *whole* bucket summed, so the caller's bucket must be
scratch, or a buffer whose other chunks it no longer reads. gloo puts the same bytes on the
wire either way (its reduce-scatter is an all-reduce inside). Whatever the primitive, the
*logical* operation is recorded (the bucket's bytes under ``reduce_scatter`` /
``all_gather``) and the ledger holds one entry, so the ZeRO volume convention above and
``parallel/zero/plan.py: comm_bytes_theory`` hold exactly on both backends.

gloo over CUDA tensors: staged through host memory
--------------------------------------------------
gloo's CUDA support is partial: some collectives take a CUDA tensor, others do not, and its
send/recv of a CUDA pointer killed the process on an H200 (``gloo::IoException`` "writev
... Bad address", 2 ranks sharing one GPU, where NCCL refuses or hangs). So when a group's
backend is gloo (for CUDA tensors: ``"gloo"``, or a ``"cuda:gloo"`` entry of a multi-backend
group) and a tensor of the op is on CUDA, every function here runs the op on host copies:
the inputs copied to the CPU, gloo on those, the outputs copied back (for an async op: when
its work's ``wait()`` returns). The ZeRO buckets then take the CPU algorithms above on the
host copy. The decision is :func:`stages_on_host` (backend string and device) and
:func:`host_staged` (a group and its tensors); a ``Group`` made with ``host_staging=True``
stages whatever its tensors (how the tests run this path on CPU, bit for bit against the
direct one), ``False`` never; ``MESHTRAIN_HOST_STAGING=1`` makes a ``Topology``'s groups
stage (:func:`host_staging_from_env`). The recorded bytes are the logical op's, the same either way;
the ledger's entry names the caller's tensors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from meshtrain.distributed.comm_stats import CommStats

ReduceOp = dist.ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, eq=False)
class Group:
    """A process group together with its mesh name, this rank's place and its books."""

    name: str  # "pp", "dp", "tp", "world", ...
    pg: dist.ProcessGroup | None = field(repr=False)
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this process's rank inside the group
    stats: CommStats = field(repr=False)
    # None: stage through host memory when the backend is gloo and a tensor is on CUDA;
    # True / False: always / never (module docstring, "gloo over CUDA tensors")
    host_staging: bool | None = field(default=None, repr=False)

    @cached_property
    def cuda_on_host(self) -> bool:
        """Whether this group stages CUDA tensors through host memory: ``host_staging``
        when set, else :func:`stages_on_host` of its backend (read once: a group's backend
        does not change, and the collectives ask on every call)."""
        if self.host_staging is not None:
            return self.host_staging
        return self.pg is not None and stages_on_host(dist.get_backend(self.pg), "cuda")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


def host_staging_from_env() -> bool | None:
    """``MESHTRAIN_HOST_STAGING=1``: a ``Topology``'s groups stage every op through host
    memory, CPU tensors included (how the GPU check's dry run runs each layout through
    the path a CUDA tensor over gloo takes); unset or anything else: decided per op."""
    return True if os.environ.get("MESHTRAIN_HOST_STAGING") == "1" else None


def stages_on_host(backend: str, device_type: str) -> bool:
    """Whether a collective of torch's ``backend`` (``dist.get_backend``'s string: "gloo",
    "nccl", or per device as "cpu:gloo,cuda:nccl") over a tensor on ``device_type`` runs on
    host copies: gloo on a CUDA tensor (module docstring)."""
    if device_type != "cuda":
        return False
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        return per_device.get("cuda") == "gloo"
    return backend == "gloo"


def host_staged(group: Group | dist.ProcessGroup | None, *tensors: torch.Tensor) -> bool:
    """Whether a collective of ``group`` (a ``Group``, a torch process group, or None: the
    default group) over ``tensors`` runs on host copies: a ``Group``'s ``host_staging``
    when set, else :func:`stages_on_host` for the first CUDA tensor (no CUDA tensor: no)."""
    if isinstance(group, Group):
        if group.host_staging is not None:
            return group.host_staging
        return any(t.is_cuda for t in tensors) and group.cuda_on_host
    if not any(t.is_cuda for t in tensors):
        return False
    return stages_on_host(dist.get_backend(group), "cuda")


def wire_device(group: Group, device: torch.device) -> torch.device:
    """The device to put tensors on that are made only to go over ``group``: ``device``,
    or the CPU where the group would stage them there anyway (gloo)."""
    device = torch.device(device)
    if group.host_staging is not None:
        return torch.device("cpu") if group.host_staging else device
    if device.type != "cuda":
        return device
    return torch.device("cpu") if group.cuda_on_host else device


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
    st = _HostStage.of(group, tensor)
    run, pre = _runner(st, dist.all_reduce)
    return _call(
        group, "all_reduce", (tensor,), async_op,
        run, *pre, _inout(st, tensor), op=op, group=group.pg, async_op=async_op,
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
    st = _HostStage.of(group, output, input)
    run, pre = _runner(st, _reduce_scatter_single)
    return _call(
        group, "reduce_scatter", (input,), async_op,
        run, *pre, _out(st, output), _in(st, input), op=op, group=group.pg, async_op=async_op,
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
    st = _HostStage.of(group, output, input)
    run, pre = _runner(st, _all_gather_single)
    return _call(
        group, "all_gather", (output,), async_op,
        run, *pre, _out(st, output), _in(st, input), group=group.pg, async_op=async_op,
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
    st = _HostStage.of(group, tensor)
    run, pre = _runner(st, dist.broadcast)
    host = _in(st, tensor) if group.rank == src else _inout(st, tensor)
    return _call(
        group, "broadcast", (tensor,), async_op,
        run, *pre, host, src=group.global_rank(src), group=group.pg, async_op=async_op,
    )  # fmt: skip


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    output_splits: Sequence[int] | None = None,
    input_splits: Sequence[int] | None = None,
    async_op: bool = False,
    label: str | None = None,
):
    """All-to-all along dim 0: rank ``i`` sends rows ``input_splits[j]`` of ``input`` to
    rank ``j`` and receives ``output_splits[j]`` rows from rank ``j``, in group-rank order
    (``None``: ``size`` equal slices, which the first dimension must divide).

    Records the bytes of ``input`` (what this rank sends, its own slice included: the wire
    carries the others, as for the other collectives); on a group of size 1 it is a copy
    and records nothing. Zero rows to or from any rank is a normal call: every member still
    enters the collective.
    """
    even = output_splits is None and input_splits is None
    if even and (output.numel() != input.numel() or input.shape[0] % group.size):
        raise ValueError(
            f"all_to_all over {group.name} (size {group.size}): input {tuple(input.shape)} "
            f"and output {tuple(output.shape)} must have equal sizes and a first dimension "
            f"divisible by {group.size}"
        )
    if group.size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done() if async_op else None
    _record(group, "all_to_all", _nbytes(input), label)
    outs = None if output_splits is None else list(output_splits)
    ins = None if input_splits is None else list(input_splits)
    st = _HostStage.of(group, output, input)
    run, pre = _runner(st, dist.all_to_all_single)
    return _call(
        group, "all_to_all", (input,), async_op,
        run, *pre, _out(st, output), _in(st, input), outs, ins, group=group.pg,
        async_op=async_op,
    )  # fmt: skip


def send(tensor: torch.Tensor, dst: int, group: Group, label: str | None = None) -> None:
    """Blocking send to group rank ``dst``."""
    _record(group, "send", _nbytes(tensor), label)
    st = _HostStage.of(group, tensor)
    run, pre = _runner(st, dist.send)
    _call(
        group, "send", (tensor,), False,
        run, *pre, _in(st, tensor), group.global_rank(dst), group.pg,
    )  # fmt: skip


def recv(tensor: torch.Tensor, src: int, group: Group, label: str | None = None) -> None:
    """Blocking receive from group rank ``src``."""
    _record(group, "recv", _nbytes(tensor), label)
    st = _HostStage.of(group, tensor)
    run, pre = _runner(st, dist.recv)
    _call(
        group, "recv", (tensor,), False,
        run, *pre, _out(st, tensor), group.global_rank(src), group.pg,
    )  # fmt: skip


def batch_p2p(
    group: Group,
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
    label: str | None = None,
    tag: int = 0,
) -> list:
    """Post sends and receives (``(tensor, group_rank)`` pairs) together; return the works.

    Batching lets a pipeline stage exchange activations with both neighbours without the
    ordering deadlocks of blocking send/recv. Wait on every returned work. ``tag``: the
    channel; between two ranks, messages of one tag match in the order they were posted.
    Staged on the host (module docstring), a receive's tensor holds the message once its
    work's ``wait()`` returns.
    """
    tensors = [t for t, _ in sends] + [t for t, _ in recvs]
    staged = bool(tensors) and host_staged(group, *tensors)
    ops, backs = [], []  # backs: per op, (device tensor, host copy) to copy back, or None
    for tensor, peer in sends:
        _record(group, "send", _nbytes(tensor), label)
        wire = _host_copy(tensor) if staged else tensor
        ops.append(dist.P2POp(dist.isend, wire, group.global_rank(peer), group.pg, tag))
        backs.append(None)
    for tensor, peer in recvs:
        _record(group, "recv", _nbytes(tensor), label)
        wire = torch.empty_like(tensor, device="cpu") if staged else tensor
        ops.append(dist.P2POp(dist.irecv, wire, group.global_rank(peer), group.pg, tag))
        backs.append((tensor, wire) if staged else None)
    if not ops:
        return []
    led = group.stats.ledger
    if not led.enabled:
        works = dist.batch_isend_irecv(ops)
        return _copied_back(works, ops, backs) if staged else works
    seq = led.enter(group, "batch_p2p", tuple(tensors), 2)
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as exc:
        led.failed(group, seq, exc)
        raise
    if staged:
        works = _copied_back(works, ops, backs)
    return [led.track(w, group, seq) for w in works]


def _copied_back(works: list, ops: list, backs: list) -> list:
    """The works of a host-staged batch, each copying its receive back once it is done
    (gloo returns one work per op, in op order; a coalesced batch's works copy back every
    receive). The send works hold their host copies until they are done."""
    if len(works) == len(ops):
        pairs = zip(works, ops, backs, strict=True)
        return [_Works([w], _copier([b]), keep=op.tensor) for w, op, b in pairs]
    everything = _copier(backs)
    return [_Works([w], everything, keep=ops) for w in works]


def _copier(backs: list):
    pairs = [b for b in backs if b is not None]
    if not pairs:
        return None

    def back() -> None:
        for device_tensor, host in pairs:
            device_tensor.copy_(host)

    return back


def reduce_scatter_bucket(out: torch.Tensor, full: torch.Tensor, group: Group, async_op=True):
    """ZeRO's gradient reduce-scatter: ``out`` (``full.numel() / N`` elements) receives the
    sum over ranks of this rank's chunk of ``full``; ``out`` may be that chunk itself. On
    CPU ``full`` is summed whole, in place (see "ZeRO's buckets" above); staged on the host
    (gloo over CUDA), a host copy of ``full`` is, and only ``out`` is written back."""
    staged = group.size > 1 and host_staged(group, out, full)
    if group.size == 1 or (full.device.type != "cpu" and not staged):
        return reduce_scatter(out, full, group, async_op=async_op)
    _check_chunks("reduce_scatter", full, out, group)
    _record(group, "reduce_scatter", _nbytes(full), None)
    summed = _host_copy(full) if staged else full
    work = _call(
        group, "reduce_scatter", (full,), True,
        dist.all_reduce, summed, group=group.pg, async_op=True,
    )  # fmt: skip
    mine = summed.narrow(0, group.rank * out.numel(), out.numel())
    then = None if _aliases(mine, out) else (lambda: out.copy_(mine))
    return _settle(_Works([work], then), async_op)


def all_gather_bucket(full: torch.Tensor, mine: torch.Tensor, group: Group, async_op=True):
    """ZeRO's parameter all-gather: ``full`` receives every rank's ``mine`` in group-rank
    order; ``mine`` may be ``full``'s own chunk. On CPU: one broadcast per rank of its chunk,
    under one ledger entry; staged on the host (gloo over CUDA), into a host copy of
    ``full``, copied back whole."""
    staged = group.size > 1 and host_staged(group, full, mine)
    if group.size == 1 or (full.device.type != "cpu" and not staged):
        return all_gather(full, mine, group, async_op=async_op)
    _check_chunks("all_gather", full, mine, group)
    _record(group, "all_gather", _nbytes(full), None)
    n = mine.numel()
    wire = torch.empty_like(full, device="cpu") if staged else full
    own = wire.narrow(0, group.rank * n, n)
    if not _aliases(own, mine):
        own.copy_(mine)
    then = (lambda: full.copy_(wire)) if staged else None

    def post() -> _Works:
        chunks = [(wire.narrow(0, r * n, n), group.global_rank(r)) for r in range(group.size)]
        works = [dist.broadcast(c, src=r, group=group.pg, async_op=True) for c, r in chunks]
        return _Works(works, then)

    return _settle(_call(group, "all_gather", (full,), True, post), async_op)


def _check_chunks(op: str, full: torch.Tensor, chunk: torch.Tensor, group: Group) -> None:
    if full.numel() != chunk.numel() * group.size:
        raise ValueError(
            f"{op} over {group.name} (size {group.size}): the bucket has {full.numel()} "
            f"elements, expected the chunk's {chunk.numel()} x {group.size}"
        )


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def _settle(work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``: a new tensor even when ``t`` is on the CPU (a forced stage
    then runs the copies a CUDA tensor's would)."""
    return t.to("cpu", copy=True)


class _HostStage:
    """The host copies of one staged op (module docstring) and the copies back."""

    def __init__(self) -> None:
        self.backs: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def of(cls, group: Group, *tensors: torch.Tensor) -> _HostStage | None:
        """A stage when ``group`` stages ``tensors`` (:func:`host_staged`), else None."""
        return cls() if host_staged(group, *tensors) else None

    def finish(self) -> None:
        for device_tensor, host in self.backs:
            device_tensor.copy_(host)
        self.backs = []

    def run(self, fn, /, *args, **kwargs):
        """``fn`` on the host copies, then the copies back: now, or when the work's
        ``wait()`` returns (``async_op``)."""
        work = fn(*args, **kwargs)
        if kwargs.get("async_op"):
            return _Works([work], self.finish, keep=args)
        self.finish()
        return work


def _runner(st: _HostStage | None, fn) -> tuple:
    """What ``_call`` runs: ``fn`` itself, or the stage's ``run`` with ``fn`` first."""
    return (fn, ()) if st is None else (st.run, (fn,))


def _in(st: _HostStage | None, t: torch.Tensor) -> torch.Tensor:
    """An input of the op: ``t``, or its host copy."""
    return t if st is None else _host_copy(t)


def _inout(st: _HostStage | None, t: torch.Tensor) -> torch.Tensor:
    """An input the op overwrites: ``t``, or its host copy, copied back when done."""
    if st is None:
        return t
    host = _host_copy(t)
    st.backs.append((t, host))
    return host


def _out(st: _HostStage | None, t: torch.Tensor) -> torch.Tensor:
    """An output of the op: ``t``, or a host buffer, copied into ``t`` when done."""
    if st is None:
        return t
    host = torch.empty_like(t, device="cpu")
    st.backs.append((t, host))
    return host


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


class _Works:
    """Several works as one handle, with an optional copy once all are done; ``keep``
    holds what the works use (host copies) until then."""

    def __init__(self, works: list, then=None, keep=None) -> None:
        self.works, self.then, self.keep = works, then, keep

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        if self.then is not None:
            self.then()
            self.then = None
        self.keep = None
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)
