"""Every node runs the same job: the resolved config and the meshtrain version agree.

A node started with another config file (another ZeRO stage, batch size, learning rate) or
another meshtrain install would otherwise join the group and run: its collectives mismatch
later and hang until the timeout, or worse, succeed with different arithmetic per node.
Before the Engine is built (no step has run), each rank compares itself with rank 0 over
the rendezvous store (the default group's store, which also answers when the group's
collectives would not): rank 0 writes its resolved config (JSON, a few KB) and version
under ``meshtrain/agree/<n>/`` (``n``: this process's n-th engine, the same on every rank);
every other rank reads it once (world - 1 reads of one key: no rank reads every rank's),
writes the first difference it finds to the ``refused`` key (the first writer wins), and
counts itself in. When all have counted, every rank reads ``refused``: if set, every rank
raises the same ConfigError naming the rank, its node and host, and the first differing
keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Any

from meshtrain.errors import ConfigError

MAX_KEYS_SHOWN = 3


def where(rank: int) -> str:
    """``rank R (node N, host H)``: how the refusal names a rank."""
    node = os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or "?"
    return f"rank {rank} (node {node}, host {socket.gethostname()})"


def differences(mine: dict, theirs: dict, path: str = "") -> list[str]:
    """The dotted keys whose values differ, with both values: ``key: A here, B on rank 0``."""
    out: list[str] = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        name = f"{path}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {json.dumps(a)} here, {json.dumps(b)} on rank 0")
    return out


def check_same_job(config: dict[str, Any], version: str, rank: int, world: int, store) -> None:
    """Raise ConfigError on every rank when any rank's ``config`` or ``version`` differs
    from rank 0's (see the module docstring). ``store``: the default group's; its own
    timeout (the group's) bounds the waits for a rank that comes late."""
    n = store.add(f"meshtrain/agree/rank{rank}", 1)
    base = f"meshtrain/agree/{n}/"
    text = json.dumps({"config": config, "version": version, "who": where(rank)}, sort_keys=True)
    if rank == 0:
        store.set(base + "rank0", text)
    else:
        first = json.loads(store.get(base + "rank0"))
        found = []
        if first["version"] != version:
            found.append(f"meshtrain {version} here, {first['version']} on rank 0")
        found += differences(config, first["config"])
        if found:
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            shown = "; ".join(found[:MAX_KEYS_SHOWN])
            more = f" (+{len(found) - MAX_KEYS_SHOWN} more)" if len(found) > MAX_KEYS_SHOWN else ""
            message = (
                f"{where(rank)} was started with a different job than {first['who']}: "
                f"{shown}{more} [config digest {digest}]; start every node with the same "
                "config and meshtrain version"
            )
            store.compare_set(base + "refused", "", message)
    if store.add(base + "counted", 1) == world:
        store.set(base + "all", "1")
    store.wait([base + "all"])
    if store.check([base + "refused"]):
        raise ConfigError(store.get(base + "refused").decode())


__all__ = ["check_same_job", "differences", "where"]
