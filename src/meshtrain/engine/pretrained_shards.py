"""A transformers weights folder written by the ranks that hold each tensor: the files
``save_pretrained`` writes (``model.safetensors``, or ``model-0000K-of-0000N.safetensors``
plus ``model.safetensors.index.json``), with no process ever holding the whole model.

Why not gather and let rank 0 write: ``engine.module_state_dict()`` makes every tensor
whole on every rank, so the export of a model sharded because it does not fit one rank
needs the whole model on each. Here each rank starts from its own share of the fp32
masters, frozen tensors and buffers (``checkpoint_save.state_pieces``: the pieces the
checkpoint writes, each element held by exactly one rank; under dp at ZeRO 0-2 the
replicas split what they share), and the files are cut as transformers cuts them
(``max_shard_size``, greedy in state-dict order; one file under it is ``model.safetensors``
with no index). Each file has one writer: the rank that holds most of its bytes (ties and
balance: at most ``ceil(files / world)`` files per rank). The ranks then walk the tensors
in rounds: in round ``r`` every writer assembles the ``r``-th tensor it writes, every
other holder of that tensor sends its runs (cast to the file's dtype, one message per
holder and tensor, point to point on the world group, counted in the comm stats as
``save_weights_send`` / ``save_weights_recv``), and the
writer appends it to its file (``consolidate.write_streamed``: header first, then each
tensor as it is assembled, hashed as it goes; a temp name renamed once complete).

What is sharded: nothing new; the files are cut from the ranks' own shares. Bytes moved:
each element once from its holder to its file's writer, less what the writer holds
itself (at most the model in the export dtype; none at one rank). Peak memory per rank:
its own share (live views, no copy) plus, in a round, the whole tensor it writes (a
holder's single run is received straight into its place; the runs of a tensor-parallel
cut go through one buffer) and copies of its runs of the other writers' tensors where
they are cast or cut into several runs: about the largest tensor under ZeRO, never the
model.

Tied weights: a transformers model whose config ties them (``tie_word_embeddings``) is
written without the later names, as ``save_pretrained`` does (``from_pretrained``
re-ties); any other module keeps each name as its own copy, as ``model.safetensors`` of
its state dict would. dtypes: the model's own (the dtype each tensor has in the module:
bf16 under ``precision: bf16``), or ``dtype`` for floating tensors.

After the files, rank 0 writes the index (``{"metadata": {"total_size"}, "weight_map"}``),
the checksum sidecar (``meshtrain_checksums.json``, checked by ``meshtrain serve``) and
removes weight files of an earlier save with another cut, as ``save_pretrained`` does.
Collectives: one ``all_gather_object`` of the piece tables (a few numbers per run), one
of the writers' results, one of rank 0's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint import tensor_files
from meshtrain.checkpoint.consolidate import entry_bytes, write_streamed
from meshtrain.checkpoint.manifest import dtype_from_name
from meshtrain.distributed.comm import wire_device
from meshtrain.engine.checkpoint_layout import unsplit_view
from meshtrain.engine.checkpoint_save import state_pieces
from meshtrain.engine.engine_view import EngineView
from meshtrain.engine.model_names import model_names
from meshtrain.errors import CheckpointError
from meshtrain.files.atomic import write_atomic
from meshtrain.files.writable import check_writable

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = "model-{:05d}-of-{:05d}.safetensors"
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def shard_bytes(max_shard_size: int | str | None) -> int | None:
    """``max_shard_size`` in bytes, as transformers reads it ("5GB" = 5e9, "5GiB" = 5 x
    2^30, an int); None: no limit (one file)."""
    if max_shard_size is None or isinstance(max_shard_size, int):
        if isinstance(max_shard_size, int) and max_shard_size <= 0:
            raise CheckpointError(f"max_shard_size {max_shard_size}: give a positive size")
        return max_shard_size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)\s*", str(max_shard_size).upper())
    if m is None:
        raise CheckpointError(
            f"max_shard_size {max_shard_size!r} is not a size; give bytes (an int) or a "
            "string such as '5GB', '500MB' or '2GiB'"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def cut_files(plan: list, limit: int | None) -> list[list]:
    """transformers' cut (``split_torch_state_dict_into_shards``): in order, a new file
    when the next tensor would take this one over ``limit``; a tensor larger than
    ``limit`` alone in its file."""
    files: list[list] = [[]]
    size = 0
    for entry in plan:
        n = entry_bytes(entry)
        if limit is not None and files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += n
    return files if files[0] else []


@dataclass
class Holdings:
    """Who holds which runs of every tensor: ``runs[canon][rank] = [(start, numel)]``, in
    the order that rank sends them."""

    runs: dict[str, dict[int, list[tuple[int, int]]]] = field(default_factory=dict)

    @classmethod
    def of(cls, tables: list[list[tuple[str, int, int]]]) -> Holdings:
        out = cls()
        for rank, table in enumerate(tables):
            for name, start, numel in table:
                out.runs.setdefault(name, {}).setdefault(rank, []).append((start, numel))
        return out

    def held(self, canon: str, rank: int) -> int:
        return sum(n for _, n in self.runs.get(canon, {}).get(rank, []))


def choose_writers(files: list[list], holdings: Holdings, world: int) -> list[int]:
    """Each file's writer: the rank holding most of its elements, at most
    ``ceil(files / world)`` files each (the largest files choose first)."""
    cap = -(-len(files) // world)
    count = [0] * world
    writers = [0] * len(files)
    order = sorted(range(len(files)), key=lambda i: -sum(entry_bytes(e) for e in files[i]))
    for i in order:
        held = [sum(holdings.held(e[1], r) for e in files[i]) for r in range(world)]
        free = [r for r in range(world) if count[r] < cap]
        writers[i] = max(free, key=lambda r: (held[r], -count[r], -r))
        count[writers[i]] += 1
    return writers


@dataclass
class SavedWeights:
    """What ``save_pretrained_shards`` wrote (file names, the index last), the bytes of
    the weights, and for this rank: bytes it wrote from its own share, bytes it received,
    and the most bytes one round held (its assembled tensor, its receive buffers and its
    outgoing runs): each element is written once, so over the ranks ``own + received``
    sums to ``total_bytes``."""

    files: list[str]
    total_bytes: int
    own_bytes: int
    received_bytes: int
    peak_bytes: int


class RoundExchange:
    """The ranks' walk through the tensors (module docstring): ``iter_chunks`` runs the
    next round and yields the tensor this rank writes in it; ``finish`` runs the rounds
    left (a rank with nothing more to write still sends its runs)."""

    def __init__(self, topology, sequences, holdings, tensors, pieces) -> None:
        self._topo = topology
        self._sequences = sequences  # per rank: the entries it writes, in order
        self._holdings = holdings
        self._mine: dict[str, list] = {}  # canon -> this rank's pieces, in table order
        for p in pieces:
            self._mine.setdefault(p.name, []).append(p)
        self._tensors = tensors
        self._world = topology.group("world")
        # NCCL sends device tensors (gloo host ones); the files are host bytes
        self._device = wire_device(self._world, topology.device)
        self._round = 0
        self.own_bytes = self.received_bytes = self.peak_bytes = 0
        self.rounds = max((len(s) for s in sequences), default=0)

    def _local(self, canon: str, dtype: torch.dtype) -> list[torch.Tensor]:
        return [
            self._tensors[p.key][p.offset : p.offset + p.numel].to(dtype)
            for p in self._mine.get(canon, [])
        ]

    def step(self) -> torch.Tensor | None:
        """One round: send this rank's runs of every writer's tensor; return the tensor
        this rank writes in it (whole, 1-D, the file's dtype), or None."""
        r, me = self._round, self._topo.rank
        self._round += 1
        sends, receiving, out = [], [], None
        for writer, seq in enumerate(self._sequences):
            if r >= len(seq):
                continue
            _key, canon, dtype, shape = seq[r]
            holders = self._holdings.runs.get(canon, {})
            if writer != me:
                if me in holders:
                    runs = self._local(canon, dtype)  # one run (ZeRO's flat cut) goes as is
                    data = runs[0] if len(runs) == 1 else torch.cat(runs)
                    sends.append((data.to(self._device), writer))
                continue
            out = torch.empty(math.prod(shape), dtype=dtype)
            for p, data in zip(self._mine.get(canon, []), self._local(canon, dtype), strict=True):
                out[p.start : p.start + p.numel] = data
                self.own_bytes += data.numel() * data.element_size()
            for h, runs in holders.items():
                if h == me:
                    continue
                if len(runs) == 1 and self._device.type == "cpu":  # straight into place
                    (start, n), runs = runs[0], None
                    buf = out[start : start + n]
                else:  # runs of a tensor-parallel cut: one message, placed below
                    buf = torch.empty(sum(n for _, n in runs), dtype=dtype, device=self._device)
                receiving.append((runs, buf, h))
        held = ([out] if out is not None else []) + [t for t, _ in sends]
        held += [buf for runs, buf, _ in receiving if runs is not None]
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in held))
        for w in self._post(sends, [(buf, h) for _, buf, h in receiving], r):
            w.wait()
        for runs, buf, _ in receiving:
            self.received_bytes += buf.numel() * buf.element_size()
            if runs is None:
                continue
            at, buf = 0, buf.cpu()
            for start, n in runs:
                out[start : start + n] = buf[at : at + n]
                at += n
        return out

    def _post(self, sends: list, recvs: list, tag: int) -> list:
        """Post the round's sends and receives. Raw ``torch.distributed`` rather than
        ``comm.batch_p2p``: ranks post different numbers of them, and the hang doctor's
        ledger matches a group's calls by their count on every rank; the bytes still go to
        the comm stats (``save_weights_send`` / ``save_weights_recv``)."""
        import torch.distributed as dist

        world, ops = self._world, []
        for tensor, peer in sends:
            world.stats.record("save_weights_send", world.name, tensor.nbytes, world.size)
            ops.append(dist.P2POp(dist.isend, tensor, peer, world.pg, tag))
        for tensor, peer in recvs:
            world.stats.record("save_weights_recv", world.name, tensor.nbytes, world.size)
            ops.append(dist.P2POp(dist.irecv, tensor, peer, world.pg, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    def iter_chunks(self, canon: str, max_numel: int | None = None):
        t = self.step()
        if t is None:
            raise CheckpointError(f"pretrained shards: round {self._round - 1} has no {canon}")
        yield 0, t

    def release(self) -> None:
        """Nothing is mapped: the assembled tensor goes with its round."""

    def finish(self) -> None:
        while self._round < self.rounds:
            self.step()


def _exchange(topology, obj: Any) -> list[Any]:
    if topology.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * topology.world_size
    dist.all_gather_object(out, obj)
    return out


def file_plan(
    engine: EngineView, names, dtype: torch.dtype | None, aliases: bool | None
) -> list[tuple]:
    """``[(key, canonical name, dtype, shape)]`` in the model's state-dict order. Tied
    names: kept as copies (``aliases`` True), dropped (False), or by default dropped for a
    transformers model that re-ties them (module docstring)."""
    if aliases is None:
        model = unsplit_view(engine)
        hf = getattr(model, "config", None) if hasattr(model, "save_pretrained") else None
        aliases = hf is None or getattr(hf, "tie_word_embeddings", True) is False
    reties = not aliases
    plan = []
    for key in names.order:
        canon = names.aliases.get(key, key)
        if canon != key and reties:
            continue
        meta = names.tensors[canon]
        out = dtype_from_name(meta["dtype"])
        if dtype is not None and out.is_floating_point:
            out = dtype
        plan.append((key, canon, out, tuple(meta["shape"])))
    return plan


def save_pretrained_shards(
    engine: EngineView,
    folder: str | Path,
    *,
    max_shard_size: int | str | None = "50GB",
    dtype: torch.dtype | None = None,
    exclude_frozen: bool = False,
    aliases: bool | None = None,
    single_name: str = SINGLE,
    index_parameters: bool = True,
    progress: bool | None = None,
) -> SavedWeights:
    """Write the model's weights into ``folder`` from the ranks (module docstring).
    Every rank calls it. ``single_name``: the file's name when there is one (DeepSpeed's
    ``save_16bit_model`` names it). ``index_parameters``: the index's metadata counts the
    elements too (``total_parameters``, as transformers writes it; accelerate's has only
    ``total_size``). Returns what was written and moved."""
    topo = engine.topology
    folder = Path(folder)
    names = model_names(engine)
    tensors, pieces, _ = state_pieces(engine, names, with_optimizer=False)
    plan = file_plan(engine, names, dtype, aliases)
    if exclude_frozen:
        plan = [e for e in plan if names.tensors[e[1]]["kind"] != "frozen"]
    files = cut_files(plan, shard_bytes(max_shard_size))
    holdings = Holdings.of(_exchange(topo, [(p.name, p.start, p.numel) for p in pieces]))
    writers = choose_writers(files, holdings, topo.world_size)
    file_names = (
        [SINGLE]
        if len(files) == 1
        else [SHARD.format(i + 1, len(files)) for i in range(len(files))]
    )
    mine = [i for i, w in enumerate(writers) if w == topo.rank]
    sequences = [
        [e for i, w in enumerate(writers) if w == r for e in files[i]]
        for r in range(topo.world_size)
    ]
    rounds = RoundExchange(topo, sequences, holdings, tensors, pieces)
    error, records = None, {}
    try:
        if mine:
            folder.mkdir(parents=True, exist_ok=True)
            need = sum(entry_bytes(e) for i in mine for e in files[i])
            check_writable(folder, CheckpointError, what="weights folder", is_dir=True,
                           need_bytes=need)  # fmt: skip
        for i in mine:
            path = folder / file_names[i]
            records[file_names[i]] = write_streamed(
                rounds, files[i], path, progress, desc=f"save {file_names[i]}"
            )
    except (OSError, CheckpointError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    rounds.finish()  # a failed writer still sends: the others' rounds must not hang
    results = _exchange(topo, (error, records))
    failed = [(r, e) for r, (e, _) in enumerate(results) if e]
    if failed:
        rank, err = failed[0]
        raise CheckpointError(f"saving the weights into {folder}: rank {rank}: {err}")
    written = file_names + ([INDEX] if len(files) > 1 else [])
    status = None
    if topo.rank == 0:
        try:
            all_records = {k: v for _, rec in results for k, v in rec.items()}
            if len(files) > 1:
                meta = {"total_size": sum(entry_bytes(e) for e in plan)}
                if index_parameters:
                    meta["total_parameters"] = sum(math.prod(e[3]) for e in plan)
                index = {
                    "metadata": meta,
                    "weight_map": {e[0]: file_names[i] for i, f in enumerate(files) for e in f},
                }
                write_atomic(folder / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
            else:
                (folder / INDEX).unlink(missing_ok=True)
            for old in folder.iterdir():  # an earlier save's other cut
                stale = SHARD_RE.match(old.name) or old.name == SINGLE
                if stale and old.name not in written:
                    old.unlink()
            tensor_files.write_sidecar(folder, all_records)
        except OSError as exc:
            status = f"{type(exc).__name__}: {exc}"
    status = _exchange(topo, status)[0]
    if status:
        raise CheckpointError(f"saving the weights index into {folder}: rank 0: {status}")
    return SavedWeights(
        written, sum(entry_bytes(e) for e in plan), rounds.own_bytes, rounds.received_bytes,
        rounds.peak_bytes,
    )  # fmt: skip


__all__ = ["save_pretrained_shards", "shard_bytes", "cut_files"]
