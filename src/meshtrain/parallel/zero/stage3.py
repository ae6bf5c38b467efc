"""ZeRO stage 3: parameters live as 1/N shards and are gathered unit by unit when used.

A *unit* is a module whose parameters are gathered together (``meshtrain.parallel.blocks``
``gather_units``: by default each block of the model's outermost ``nn.ModuleList`` /
``nn.Sequential`` and each other child along the way, or the instances of the classes
named in ``zero_optimization.stage3_module_classes``). Each
unit's parameters form their own buckets (``FlatGroup`` ``keys``), one per param group it
has parameters in (frozen and trainable, each dtype, decayed or not). The buckets of a
unit under ``COALESCE_BYTES`` each share one all-gather: this rank's chunks are packed
into one byte buffer, gathered, and copied out into each bucket's buffer (the copies are of
small buckets only; larger ones are gathered in place, one all-gather each). Measured on
the lever benchmark's QLoRA MiniLM at 2 ranks: a transformer layer's three buckets (its
packed 4-bit base, its fp32 norms and biases, its LoRA adapters) took three all-gathers
of two gloo broadcasts each, 47 all-gathers per step in all; 17 coalesced (the same
59.3 MB).

Life of a unit's parameters in one training micro-step::

    forward pre-hook   gather (wait for the prefetch, or all-gather now) and start the
                       all-gather of the next units in last forward's order, up to
                       stage3_prefetch_bucket_size elements
    forward post-hook  free: the gathered buffer's storage is resized to 0 bytes and the
                       parameters become empty placeholders; hook the outputs
    output grad hook   the gradient reached this unit's outputs: gather again, prefetch
                       the unit that ran before it
    grads reduced      the GradReducer hands the bucket's gradients to the reduce-scatter
                       and frees the bucket (autograd accumulates a parameter's gradient
                       once all its uses are differentiated, so nothing needs it after)

So each unit is all-gathered twice per micro-step and its gradient reduce-scattered
once: 3 Psi of the ZeRO paper's volume against data parallelism's 2 Psi. Tied weights
used by two units are gathered by each (once more per extra use). Parameters smaller
than stage3_param_persistence_threshold and parameters outside every unit stay whole on
every rank (stage-2 treatment). Frozen parameters of a unit are sharded as well, in
buckets of their own that are gathered with the unit's and freed in backward once the
unit's input gradients exist (``meshtrain.parallel.zero.frozen``).

Freeing. Autograd saves views of the weights it needs for backward (``F.linear`` on a 3-D
input saves ``weight.t()``), and those views share the gathered buffer's storage. Dropping
the Python reference to the buffer would therefore keep every unit alive until its
backward. Instead each bucket has one buffer for its whole life, and freeing it resizes its
*storage* to 0 bytes (``untyped_storage().resize_(0)``, as FSDP2 does): the saved views
stay valid objects without memory, and the gather before backward resizes the same storage
back and all-gathers into it, so the saved views see the values again. A rank therefore
holds only the units being used (plus the prefetched ones) at any time.

Activation checkpointing: the recomputation inside backward calls the block's forward
directly, after the output grad hook has gathered the unit, and the post-hook does not
free while autograd is running (``_in_backward``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.parallel.zero.flat_group import Bucket, FlatGroup
from meshtrain.parallel.zero.partition import full_numel


def assign_units(
    model: nn.Module, units: list[nn.Module], threshold: int
) -> dict[nn.Parameter, int]:
    """Unit index of each trainable parameter to shard: the first unit holding it.

    Parameters under ``threshold`` elements and those in no unit are left out (whole)."""
    owner: dict[nn.Parameter, int] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            if p.requires_grad and full_numel(p) >= threshold and p not in owner:
                owner[p] = i
    return owner


# buckets at most this many bytes each share their unit's one all-gather (module docstring)
COALESCE_BYTES = 1 << 20


class _Coalesced:
    """One all-gather of several buckets' chunks packed in ``packed`` (rank-major: rank
    ``r``'s region holds its chunk of each bucket at ``offsets``); the first ``wait``
    copies each rank's chunks out into the buckets' full buffers."""

    def __init__(self, work, packed: torch.Tensor, parts: list, size: int) -> None:
        self.work, self.packed, self.parts, self.size = work, packed, parts, size

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        ranks = self.packed.numel() // self.size
        for full, offset, nbytes in self.parts:
            out = full.view(torch.uint8)
            for r in range(ranks):
                src = self.packed.narrow(0, r * self.size + offset, nbytes)
                out.narrow(0, r * nbytes, nbytes).copy_(src)
        self.packed = self.parts = None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(eq=False)
class Unit:
    module: nn.Module
    buckets: list[tuple[FlatGroup, Bucket]] = field(default_factory=list)
    numel: int = 0
    frozen: list[tuple[FlatGroup, Bucket]] = field(default_factory=list)  # no grads to reduce
    backward_pass: int = -1  # the forward pass whose backward already gathered this unit


class ParamGatherer:
    """Installs the stage-3 hooks on ``units`` for the sharded ``groups``."""

    def __init__(
        self,
        model: nn.Module,
        units: list[nn.Module],
        groups: list[FlatGroup],
        dp_group: Group,
        prefetch_numel: int,
        frozen: list[FlatGroup] = (),
    ) -> None:
        self.dp_group = dp_group
        self.prefetch_numel = prefetch_numel
        self.groups = [*groups, *frozen]
        frozen_ids = {id(g) for g in frozen}
        self._buf: dict[int, torch.Tensor] = {}  # bucket id -> its buffer (storage may be 0 B)
        self._live: set[int] = set()  # bucket ids whose buffer holds gathered values now
        self._work: dict[int, object] = {}  # bucket id -> pending all-gather
        where = {p: (g, g.bucket_of[p]) for g in self.groups for p in g.params}
        self.units: list[Unit] = []
        for module in units:
            unit = Unit(module)
            seen: set[int] = set()
            for p in module.parameters():
                gb = where.get(p)
                if gb is not None and id(gb[1]) not in seen:
                    seen.add(id(gb[1]))
                    unit.buckets.append(gb)
                    unit.numel += gb[1].numel
                    if id(gb[0]) in frozen_ids:
                        unit.frozen.append(gb)
            if unit.buckets:
                self.units.append(unit)
        self._order: list[Unit] = []  # units in the order the current forward ran them
        self._last_order: list[Unit] = []
        self._pass = 0
        self._backward_units: set[int] = set()  # this pass's units with outputs needing grad
        self._input_hooks: list = []  # last pass's frozen-release hooks (a leaf input keeps its own)
        self._paused = False  # hooks do nothing (``paused``: one rank runs a module alone)
        self._handles = [model.register_forward_pre_hook(self._root_pre)]
        for unit in self.units:
            pre = unit.module.register_forward_pre_hook(self._pre(unit), with_kwargs=True)
            self._handles.append(pre)
            self._handles.append(unit.module.register_forward_hook(self._post(unit)))

    # one bucket ------------------------------------------------------------------------------
    def _start_bucket(self, g: FlatGroup, b: Bucket) -> None:
        """Launch the all-gather of ``b`` into its buffer, re-allocating its storage (async)."""
        if id(b) in self._live:
            return
        full, src = self._claim(g, b)
        self._work[id(b)] = comm.all_gather_bucket(full, src, self.dp_group)

    def _claim(self, g: FlatGroup, b: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """``b``'s full buffer, its storage allocated again and marked live, and this rank's
        chunk of it (brought to the device when parameters are offloaded)."""
        src = b.in_shard(g.param_shard)
        if src.device != g.device:  # parameters offloaded to the CPU
            src = src.to(g.device, non_blocking=True)
        full = self._buf.get(id(b))
        if full is None:
            full = self._buf[id(b)] = torch.empty(b.numel, dtype=g.dtype, device=g.device)
        else:  # the same storage object the saved views of the last forward point at
            full.untyped_storage().resize_(b.numel * g.itemsize)
        self._live.add(id(b))
        return full, src

    def _start_coalesced(self, pairs: list[tuple[FlatGroup, Bucket]]) -> None:
        """One all-gather for the small buckets ``pairs`` (module docstring; async)."""
        sizes = [b.chunk * g.itemsize for g, b in pairs]
        size, rank = sum(sizes), self.dp_group.rank
        packed = torch.empty(
            size * self.dp_group.size, dtype=torch.uint8, device=pairs[0][0].device
        )
        mine, parts, offset = packed.narrow(0, rank * size, size), [], 0
        for (g, b), nbytes in zip(pairs, sizes, strict=True):
            full, src = self._claim(g, b)
            mine.narrow(0, offset, nbytes).copy_(src.reshape(-1).view(torch.uint8))
            parts.append((full, offset, nbytes))
            offset += nbytes
        work = _Coalesced(comm.all_gather_bucket(packed, mine, self.dp_group), packed, parts, size)
        for _, b in pairs:
            self._work[id(b)] = work

    def _finish_bucket(self, g: FlatGroup, b: Bucket) -> None:
        """Wait for ``b``'s gather and point its parameters at the full buffer."""
        work = self._work.pop(id(b), None)
        if work is None:
            return
        work.wait()
        for p, view in g.views(b, self._buf[id(b)], base=b.start):
            p.data = view

    def release_bucket(self, g: FlatGroup, b: Bucket) -> None:
        """Free ``b``'s gathered values (storage resized to 0 bytes, so autograd's saved
        views hold nothing either); its parameters become empty placeholders."""
        if id(b) not in self._live:
            return
        self._live.discard(id(b))
        work = self._work.pop(id(b), None)
        if work is not None:
            work.wait()
        self._buf[id(b)].untyped_storage().resize_(0)
        for p in b.params:
            p.data = torch.empty(0, dtype=g.dtype, device=g.device)

    def gathered_bytes(self) -> int:
        """Bytes of the full buckets alive right now."""
        return sum(self._buf[i].untyped_storage().nbytes() for i in self._live)

    # units -------------------------------------------------------------------------------------
    def _start(self, unit: Unit) -> None:
        small = [
            (g, b)
            for g, b in unit.buckets
            if id(b) not in self._live and b.numel * g.itemsize <= COALESCE_BYTES
        ]
        if len(small) > 1 and self.dp_group.size > 1 and len({g.device for g, _ in small}) == 1:
            self._start_coalesced(small)
        for g, b in unit.buckets:
            self._start_bucket(g, b)  # the rest (a live bucket is skipped)

    def start(self, unit: Unit) -> None:
        """Launch ``unit``'s all-gathers without waiting (a prefetch; ``gather`` waits)."""
        self._start(unit)

    def gather(self, unit: Unit) -> None:
        self._start(unit)
        for g, b in unit.buckets:
            self._finish_bucket(g, b)

    def release(self, unit: Unit) -> None:
        for g, b in unit.buckets:
            self.release_bucket(g, b)

    def release_all(self) -> None:
        for g in self.groups:
            for b in g.buckets:
                self.release_bucket(g, b)

    @contextmanager
    def gathered(self, module: nn.Module | None = None):
        """Make ``module``'s sharded parameters (default: all) whole inside the block and
        free them on exit; changes made inside are not kept. Every rank must enter it."""
        wanted = None if module is None else {id(p) for p in module.parameters()}
        buckets = [
            (g, b)
            for g in self.groups
            for b in g.buckets
            if wanted is None or any(id(p) in wanted for p in b.params)
        ]
        for g, b in buckets:
            self._start_bucket(g, b)
        for g, b in buckets:
            self._finish_bucket(g, b)
        try:
            yield
        finally:
            for g, b in buckets:
                self.release_bucket(g, b)

    @contextmanager
    def paused(self):
        """The hooks do nothing inside: one rank may run modules alone (no collective, no
        change to the recorded unit order that prefetching follows). Parameters it uses
        must be whole already (``gathered``); peft's ``save_pretrained`` runs a prompt
        encoder to save its embeddings, on the main rank only."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _prefetch(self, order: list[Unit], start: int, step: int) -> None:
        budget, i = self.prefetch_numel, start
        while 0 <= i < len(order) and budget > 0:
            # backward: skip units whose outputs need no gradient (a frozen embedding):
            # their backward never runs, a gather would only be freed again unused
            if step > 0 or id(order[i]) in self._backward_units:
                self._start(order[i])
                budget -= order[i].numel
            i += step

    # hooks -----------------------------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        if _in_backward() or self._paused:
            return
        if self._order:
            self._last_order = self._order
        self._order = []
        self._backward_units = set()
        for h in self._input_hooks:
            h.remove()
        self._input_hooks.clear()
        self._pass += 1

    def _pre(self, unit: Unit):
        def hook(module, args, kwargs):
            if self._paused:
                return
            self.gather(unit)
            if _in_backward():
                return
            if unit.frozen and torch.is_grad_enabled():
                self._free_frozen_after_input_grads(unit, (args, kwargs))
            pos = len(self._order)
            self._order.append(unit)
            if self._last_order[pos : pos + 1] == [unit]:
                self._prefetch(self._last_order, pos + 1, +1)

        return hook

    def _post(self, unit: Unit):
        def hook(module, args, output):
            if _in_backward() or self._paused:
                return
            self.release(unit)
            if not torch.is_grad_enabled():
                return
            pass_id = self._pass
            position = len(self._order) - 1
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(unit, pass_id, position))
                    self._backward_units.add(id(unit))

        return hook

    def _free_frozen_after_input_grads(self, unit: Unit, inputs) -> None:
        """Free ``unit``'s frozen buckets in backward once the gradient of each of its
        inputs that needs one has been computed: no autograd node reading the frozen
        weights is left then. Without such inputs they wait for ``release_all``."""
        flat = tree_flatten(inputs)[0]
        needing = {id(t): t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad}
        if not needing:
            return
        pending = [len(needing)]

        def hook(grad):
            pending[0] -= 1
            if pending[0] == 0:
                for g, b in unit.frozen:
                    self.release_bucket(g, b)
            return None

        for t in needing.values():
            self._input_hooks.append(t.register_hook(hook))

    def _grad_hook(self, unit: Unit, pass_id: int, position: int):
        def hook(grad):
            if unit.backward_pass == pass_id:
                return None
            unit.backward_pass = pass_id
            self.gather(unit)
            self._prefetch(self._order, position - 1, -1)
            return None

        return hook

    def keep_hooks(self, handles: list) -> None:
        """Hooks registered elsewhere after this gatherer's (8-bit codes), removed with it."""
        self._handles += handles

    def remove(self) -> None:
        for h in [*self._handles, *self._input_hooks]:
            h.remove()
        self._handles.clear()
        self._input_hooks.clear()
