"""Forking child processes from a process that may hold garbage with live threads.

A forked child inherits the parent's whole heap, including objects that are already
unreachable but not yet collected, and none of the parent's threads. If the child's
garbage collector reaches such an object whose destructor joins or signals a thread, the
child waits forever for a thread that does not exist in it. The case that hung CI: an
``Accelerator`` made earlier in the process and dropped after ``destroy_process_group``
still held its gloo groups in a reference cycle; a forked rank's first collection ran
``~ProcessGroupGloo``, which joins its worker threads.

``heap_frozen()`` moves the parent's heap out of the collector (``gc.freeze``, which the
Python docs recommend before a fork for copy-on-write too) while the children are forked,
and hands it back to the parent's collector afterwards, where those threads exist and the
destructors return. Each child keeps the frozen heap outside its collector for good: what
it inherited in cycles is never destroyed there, only its own garbage.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["fork", "heap_frozen"]


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Start ``fork``-method processes or a pool inside this (their children never come
    back out of it; for a bare ``os.fork`` use :func:`fork`)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def fork() -> int:
    """``os.fork()`` with the heap kept outside the child's collector."""
    gc.freeze()
    pid = os.fork()
    if pid:
        gc.unfreeze()
    return pid
