"""Only rank 0 calling save: a clear CheckpointError, and no ``.tmp-<tag>`` left (issue 18).

Before, rank 0 timed out in ``all_gather_object`` with gloo's raw text and left its
``.tmp-<tag>`` folder. Two real processes, a 6 s collective timeout; rank 1 goes on
without saving (as under ``if rank == 0: engine.save_checkpoint(...)``).
"""

from __future__ import annotations

import time
from pathlib import Path

from meshtrain.launch.processes import run_on_ranks


def _only_rank0_saves(save_dir: str) -> str:
    import torch.distributed as dist

    from meshtrain.checkpoint import save_shards
    from meshtrain.distributed.topology import Topology
    from meshtrain.errors import CheckpointError
    from tests.checkpoint.common import full_state, meta, shard

    topo = Topology()
    result = "saved?!"
    if dist.get_rank() == 1:
        time.sleep(12)  # training on, never calling save; past rank 0's timeout
        result = "skipped"
    else:
        tensors, pieces = shard(full_state(0), 0, 2)
        try:
            save_shards(save_dir, "t1", group=topo.group("world"), tensors=tensors,
                        pieces=pieces, meta=meta())  # fmt: skip
        except CheckpointError as exc:
            result = str(exc)
    # a group that timed out cannot meet in the harness's closing barrier: drop it here
    dist.destroy_process_group()
    return result


def test_only_rank0_saving_says_every_rank_must_call_it(tmp_path: Path):
    out = run_on_ranks(
        _only_rank0_saves, 2, (str(tmp_path),), timeout=120, collective_timeout_minutes=0.1
    )
    msg = out[0]
    assert "Every rank must call save_checkpoint (or save_shards) at the same step" in msg, msg
    assert "`if rank == 0:`" in msg and "rank 0 could not exchange its status" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .tmp-t1, no latest
