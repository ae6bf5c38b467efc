"""The ledger's reach outside the process: the rendezvous store and the doctor folder.

Each call is safe to make while things go wrong: a store write runs on a helper thread
with a deadline (a store whose host died must not block the exit), a file is replaced
atomically (a reader never sees half a record).
"""

from __future__ import annotations

import contextlib
import threading

from meshtrain.files.atomic import write_atomic


def pg_timeout_seconds() -> float | None:
    """The default process group's collective timeout, in seconds (None if unknown)."""
    import torch
    import torch.distributed as dist

    try:
        pg = dist.distributed_c10d._get_default_group()
        for device in ("cpu", "cuda"):
            try:
                return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
            except Exception:  # noqa: BLE001 - backend without that device
                continue
    except Exception:  # noqa: BLE001 - private API moved: no watchdog rather than a crash
        return None
    return None


def store_set(key: str, value: str, deadline_s: float = 3.0) -> None:
    """``store.set`` on a helper thread: a store whose host died must not block us."""

    def put() -> None:
        try:
            root_store().set(key, value)
        except Exception:  # noqa: BLE001 - the report is best effort
            pass

    try:
        t = threading.Thread(target=put, name="meshtrain-doctor-publish", daemon=True)
        t.start()
    except RuntimeError:  # no new threads this late in interpreter shutdown
        return
    t.join(deadline_s)


def write_status(path: str, text: str) -> None:
    """Replace a status file (best effort: a doctor's file must never stop training)."""
    with contextlib.suppress(OSError):
        write_atomic(path, text)


def root_store():
    """The default group's store below its prefixes (torch's ``default_pg/``, meshtrain's
    per-attempt one): keys there can be read by a plain client of the same address."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def store_address() -> list | None:
    """``[host, port]`` of the root store when it is a TCP store (else None)."""
    try:
        store = root_store()
        return [store.host, int(store.port)]
    except Exception:  # noqa: BLE001 - a HashStore/FileStore: the folder is all there is
        return None
