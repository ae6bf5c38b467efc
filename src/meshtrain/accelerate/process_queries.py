"""Where this process is and what runs where, under accelerate's names and meanings:
process indices, ``wait_for_everyone``, ``main_process_first``, ``print``, the
``on_*_process`` decorators, ``split_between_processes``, triggers and the cross-process
collectives (``gather``, ``gather_for_metrics``, ``reduce``, ``pad_across_processes``).
Built from the Accelerator's topology and this process's local rank; the Accelerator
hands accelerate's names on to it (``forwarded``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from meshtrain.accelerate import collectives as col
from meshtrain.accelerate import processes


class ProcessQueries:
    def __init__(self, topology, local_rank: int) -> None:
        self.topology = topology
        self.local_rank = local_rank
        self._trigger = False  # set_trigger: a flag any rank sets, every rank sees

    # where this process is ---------------------------------------------------------------------
    @property
    def process_index(self) -> int:
        return self.topology.rank

    @property
    def local_process_index(self) -> int:
        return self.local_rank

    @property
    def num_processes(self) -> int:
        return self.topology.world_size

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def distributed_type(self) -> str:
        return (
            "NO"
            if self.num_processes == 1
            else "MULTI_GPU"
            if self.device.type == "cuda"
            else "MULTI_CPU"
        )

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            torch.distributed.barrier()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (downloads, preprocessing), then the rest."""
        with self._first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The local main process of each node runs the block first, then the rest."""
        with self._first(self.is_local_main_process):
            yield

    @contextmanager
    def _first(self, first: bool) -> Iterator[None]:
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # decorators and splitting ------------------------------------------------------------------
    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on the main process only (None elsewhere)."""
        return processes.run_on(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on each node's local main process only."""
        return processes.run_on(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on the last process only."""
        return processes.run_on(lambda: self.is_last_process, function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        """Decorator: run on the process of global index ``process_index`` only
        (``@accelerator.on_process(process_index=1)``)."""
        if function is None:
            return lambda f: self.on_process(f, process_index)
        return processes.run_on(lambda: self.process_index == process_index, function)

    def on_local_process(
        self, function: Callable | None = None, local_process_index: int | None = None
    ):
        """Decorator: run on the process of local index ``local_process_index`` only."""
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index)
        return processes.run_on(lambda: self.local_process_index == local_process_index, function)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor or dict of those
        (``apply_padding``: equal lengths, for ``gather``); see ``processes``."""
        yield processes.split(inputs, self.num_processes, self.process_index, apply_padding)

    # cross-process helpers -----------------------------------------------------------------------
    def dp(self):
        """The data-parallel group (None alone) and its size: what the collectives run over."""
        t = self.topology
        return (t.dp_group.pg if t.dp_size > 1 else None), t.dp_size

    def gather(self, data: Any) -> Any:
        """Every rank's tensors concatenated along dim 0 (same shapes on every rank)."""
        return col.gather(data, *self.dp())

    def gather_for_metrics(
        self, data: Any, use_gather_object: bool = False, loader: Any = None
    ) -> Any:
        """``gather``, minus the rows the sampler repeated to even out the ranks: over a
        prepared loader's pass, each row of the dataset comes back exactly once (in
        dataset order for an unshuffled loader). Call it once per batch of the loader
        being iterated (``loader``, a ``PreparedDataLoader``); non-tensor data (a list of
        rows) goes through ``gather_object``."""
        group, world = self.dp()
        # accelerate's rule: the gathered global batch is in slot order; at the pass's end
        # only its first ``remainder`` rows are real
        keep = None if loader is None or world == 1 else loader.rows_kept()
        if use_gather_object or not col.has_tensor(data):
            rows = [x for part in col.gather_object(list(data), group, world) for x in part]
            return rows if keep is None else rows[:keep]
        gathered = col.gather(data, group, world)
        return gathered if keep is None else col.map_tensors(lambda t: t[:keep], gathered)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        return col.reduce(data, *self.dp(), reduction=reduction)

    def pad_across_processes(
        self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        group, world = self.dp()
        return col.pad_across_processes(data, group, world, dim, pad_index, pad_first)

    # triggers: a flag any rank sets, every rank sees -----------------------------------------------
    def set_trigger(self) -> None:
        self._trigger = True

    def check_trigger(self) -> bool:
        flag = torch.tensor([1 if self._trigger else 0], device=self.device)
        if self.num_processes > 1:
            col.all_reduce_staged(flag, None)
        self._trigger = False
        return bool(flag.item() > 0)


__all__ = ["ProcessQueries"]
