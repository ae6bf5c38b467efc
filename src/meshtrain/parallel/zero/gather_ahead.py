"""ZeRO stages 1-2: the parameter all-gather after a step, overlapped with the next forward.

After the optimizer step every rank holds updated values only in its own chunk of each
parameter bucket; an all-gather per bucket (``Psi`` bytes in all, ``comm.all_gather_bucket``)
makes the buckets whole again. Waiting for all of them at the end of ``step`` leaves the
compute idle while they run. Instead ``launch`` starts every bucket's all-gather
asynchronously, in the order the last forward first used the buckets (first used, first
launched: backward order reversed before any forward ran), and a forward pre-hook on each
module that owns parameters waits only for the buckets holding *its own* parameters
(``module._parameters``, not its children's) just before it runs. The first layers
therefore compute while the all-gathers of the later layers are still on the wire.

Nothing else changes: the same bytes move, in the same collectives, into the same storage,
so losses and parameters are bit-identical to waiting at once.

Who else must wait (``wait_all``): anything that reads whole parameters outside a forward
(``ZeroStage.gathered`` and so ``module_state_dict``, ``reload_params``, a module's
``state_dict`` through a state-dict pre-hook), the next backward (a bucket whose modules the
forward never called), and the next optimizer step, which writes this rank's chunk in place
while its broadcast may still read it. A parameter read directly (``p.data``, ``p.norm()``)
between ``engine.step()`` and the next forward may still be in flight: go through
``engine.module_state_dict()`` / ``engine.gathered_parameters()`` or set
leave ``zero_optimization.overlap_param_gather`` at its default, false, which waits at the end of
``step``. That hazard is why it is opt-in.

A parameter that the forward of a module *other* than its owner uses before the owner runs
(a parent reading ``self.child.weight`` without calling ``child``) is the one pattern the
owner hooks cannot see: its bucket would be read before it arrived. Tied weights are owned
by every module holding them and are safe. Under ``torch.compile`` the hooks are traced
like ZeRO-3's (graph breaks at the waits).
"""

from __future__ import annotations

from torch import nn

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.parallel.zero.flat_group import Bucket, FlatGroup


class GatherAhead:
    """Pending parameter all-gathers of the sharded, whole-parameter groups, waited per
    owning module (see the module docstring)."""

    def __init__(self, model: nn.Module, groups: list[FlatGroup], dp_group: Group) -> None:
        self.dp_group = dp_group
        self.buckets: list[tuple[FlatGroup, Bucket]] = [
            (g, b) for g in groups for b in reversed(g.buckets)
        ]  # backward order reversed: roughly forward order before any forward ran
        where = {p: i for i, (g, b) in enumerate(self.buckets) for p in b.params}
        self._pending: dict[int, object] = {}  # bucket index -> its all-gather's work
        self._order = list(range(len(self.buckets)))  # launch order
        self._first_use: list[int] = []  # bucket indices in the order this forward waited
        self._handles = []
        for module in model.modules():
            mine = sorted({where[p] for p in module._parameters.values() if p in where})
            if mine:
                self._handles.append(module.register_forward_pre_hook(self._pre(mine)))
                self._handles.append(module.register_state_dict_pre_hook(self._wait_hook))

    def _pre(self, indices: list[int]):
        def hook(module, args):
            if self._pending:
                for i in indices:
                    work = self._pending.pop(i, None)
                    if work is not None:
                        work.wait()
                        self._first_use.append(i)

        return hook

    def _wait_hook(self, *args) -> None:
        self.wait_all()

    def launch(self) -> None:
        """Start every bucket's all-gather (this rank's chunk is already updated); first
        those the last forward used first."""
        self.wait_all()
        if self._first_use:  # the last forward's order, then any bucket it did not use
            self._order = list(dict.fromkeys(self._first_use + self._order))
            self._first_use = []
        for i in self._order:
            g, b = self.buckets[i]
            full = b.view(g.param_flat)  # in place: this rank's chunk is the input
            self._pending[i] = comm.all_gather_bucket(
                full, b.owned(g.param_flat, g.rank), self.dp_group
            )

    def wait_all(self) -> None:
        """Finish every pending all-gather (in launch order)."""
        while self._pending:
            self._pending.pop(next(iter(self._pending))).wait()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def remove(self) -> None:
        self.wait_all()
        for h in self._handles:
            h.remove()
        self._handles = []
