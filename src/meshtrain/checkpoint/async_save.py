"""Asynchronous checkpoint save: training blocks only while the state is copied to host.

``checkpoint.async_save: true`` turns ``engine.save_checkpoint`` into two halves:

1. **stage** (the calling thread, every rank): each tensor the rank would write is copied
   into a host buffer this saver owns (page-locked on CUDA, so the device-to-host copy
   runs at full bandwidth; reused by the next save when the key, shape and dtype match,
   so a steady run allocates nothing). The JSON rank state and meta are deep-copied. This
   is the whole time the step is blocked: one copy of the rank's own shard, the same
   bytes a synchronous save writes.
2. **write** (one background thread per rank): :func:`meshtrain.checkpoint.writer.save_shards`
   runs unchanged on the staged copies -- shard, fsync, sha256, manifest, rename,
   ``latest`` -- so the commit protocol and what a SIGKILL at any point leaves behind are
   exactly the synchronous save's (docs/checkpoints.md, *Crash safety*).

Its status exchanges (three ``all_gather_object`` of a few KB) go over a process group
of its own (gloo, made once, on the first asynchronous save, by every rank in the same
order) so they never interleave with the training collectives of the main thread.

Ordering and errors:

* a save waits for the previous background write to finish before staging (the buffers
  are reused, and two commits never race on ``latest``);
* a background failure is kept and raised (``CheckpointError``, naming the tag) by the
  next :meth:`AsyncSaver.check` -- the engine calls it in every ``step()`` and every
  save -- so it is never silent; :meth:`AsyncSaver.wait` raises it too;
* the thread is not a daemon: a process that returns from its script waits for the write
  to finish (call ``engine.wait_for_checkpoint()`` before ``destroy_process_group``).

Memory: one host copy of this rank's shard (the same bytes as its file), held from one
save to the next.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshtrain.distributed.comm import Group
from meshtrain.errors import CheckpointError


def _own_group(world: Group | None) -> Group | None:
    """A gloo group over ``world``'s ranks for the background thread's status exchange."""
    if world is None or world.pg is None:
        return world
    import torch.distributed as dist

    from meshtrain.distributed.comm_stats import CommStats

    pg = dist.new_group(ranks=list(world.ranks), backend="gloo")
    return Group("checkpoint", pg, world.ranks, world.rank, CommStats())


class AsyncSaver:
    """Stages a rank's checkpoint tensors on the host and writes them in a background thread.

    One per engine (``engine.checkpoint_saver``); see the module docstring.
    """

    def __init__(self, world: Group | None) -> None:
        self._world = world
        self._group: Group | None = None
        self._made_group = False
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: str | None = None  # the tag being written
        self.last_path: Path | None = None  # the last committed checkpoint

    # ------------------------------------------------------------------ staging
    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` in this saver's reused buffers (call after ``wait``)."""
        out: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            t = t.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.device.type == "cuda"
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self._buffers[key] = buf
            buf.copy_(t, non_blocking=buf.is_pinned())
            out[key] = buf
        for key in set(self._buffers) - set(tensors):
            del self._buffers[key]  # a key this save no longer has
        if any(b.is_pinned() for b in out.values()) and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the copies landed before the write
        return out

    # ------------------------------------------------------------------ writing
    def submit(
        self,
        save: Callable[..., Path],
        *,
        tag: str,
        tensors: dict[str, torch.Tensor],
        on_commit: Callable[[Path], None] | None = None,
        **kwargs: Any,
    ) -> None:
        """Wait for the previous write (raising its failure), stage ``tensors``, and run
        ``save(tensors=staged, group=<own group>, tag=tag, **kwargs)`` in the background;
        ``on_commit(path)`` runs there after the commit (every rank)."""
        self.wait()
        if not self._made_group:
            self._group, self._made_group = _own_group(kwargs.pop("group", None)), True
        else:
            kwargs.pop("group", None)
        staged = self.stage(tensors)
        # JSON state is built from live objects (scheduler lists, ...): freeze it now
        for key in ("rank_state", "meta"):
            if kwargs.get(key) is not None:
                kwargs[key] = copy.deepcopy(kwargs[key])
        group = self._group

        def run() -> None:
            try:
                path = save(tensors=staged, group=group, tag=tag, **kwargs)
                if on_commit is not None:
                    on_commit(path)
                self.last_path = path
            except BaseException as exc:  # noqa: BLE001 - kept for the next step / save / wait
                self._error = exc

        self._pending = tag
        self._thread = threading.Thread(target=run, name=f"meshtrain-save-{tag}", daemon=False)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A background write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise a finished background write's failure (non-blocking; the engine calls it
        every step)."""
        if self._thread is not None and not self._thread.is_alive():
            self._join()

    def wait(self) -> Path | None:
        """Block until the background write is done; raise its failure. Returns the last
        committed checkpoint's path (None before the first)."""
        if self._thread is not None:
            self._join()
        return self.last_path

    def _join(self) -> None:
        assert self._thread is not None
        self._thread.join()
        self._thread = None
        tag, self._pending = self._pending, None
        err, self._error = self._error, None
        if err is not None:
            raise CheckpointError(
                f"the asynchronous save of checkpoint {tag!r} failed in the background: "
                f"{err}; the previous checkpoint is still `latest`. Fix the cause and save again"
            ) from err


__all__ = ["AsyncSaver"]
