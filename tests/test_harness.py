"""The multi-rank harness itself: results come back, failures and hangs are surfaced."""

from __future__ import annotations

import time

import pytest

from tests.harness import RankFailedError, run_ranks


def _ranks_and_sum(scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t) * scale


def _planted_exception():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()  # rank 0 would wait forever; the harness must kill it


def _planted_hang():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    return "done"


def test_results_come_back_by_rank():
    assert run_ranks(_ranks_and_sum, 2, 10.0) == [(0, 2, 30.0), (1, 2, 30.0)]


def test_exception_on_rank1_is_the_failure():
    with pytest.raises(RankFailedError) as info:
        run_ranks(_planted_exception, 2, timeout=240)
    msg = str(info.value)
    assert info.value.rank == 1
    assert "rank 1 raised ValueError: planted failure on rank 1" in msg
    assert "_planted_exception" in msg  # the child's traceback is in the message


def test_hang_times_out_with_stacks():
    # rank 1 sleeps 600 s: an error at all (not a result) means the 8 s timeout cut it
    with pytest.raises(RankFailedError) as info:
        run_ranks(_planted_hang, 2, timeout=8)
    msg = str(info.value)
    assert "did not finish within 8 s" in msg
    assert "Python stacks of rank 1" in msg and "_planted_hang" in msg


def test_a_taken_port_is_retried_on_a_fresh_one(monkeypatch):
    """free_port() is free when chosen; if another process binds it before rank 0's store
    does, rank 0 fails joining (EADDRINUSE) and run_on_ranks starts the group again."""
    import socket

    from meshtrain.launch import processes

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    ports = [holder.getsockname()[1]]
    real = processes.free_port
    monkeypatch.setattr(processes, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert run_ranks(_ranks_and_sum, 2, 1.0, timeout=120) == [(0, 2, 3.0), (1, 2, 3.0)]
    finally:
        holder.close()
    assert ports == []  # the taken port was handed out first


def _collect_garbage():
    import gc

    return gc.collect() >= 0


def test_a_forked_rank_never_destroys_the_parents_garbage_groups():
    """An Accelerator made in this process and dropped after ``destroy_process_group``
    leaves its gloo groups in a reference cycle. A forked rank that collected that cycle
    ran ``~ProcessGroupGloo``, which joins worker threads that exist only here, and hung
    (the CI hang of test_user_streams after test_trackers). The planted cycle below is
    that state; the ranks' collection must not reach it."""
    import gc

    import torch.distributed as dist

    from meshtrain.launch.processes import free_port

    gc.disable()  # keep the planted cycle alive until the ranks have forked
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        cycle = {"group": dist.new_group([0])}
        cycle["self"] = cycle
        dist.destroy_process_group()
        del cycle
        assert run_ranks(_collect_garbage, 2, timeout=60) == [True, True]
    finally:
        gc.enable()
        gc.collect()  # here the groups' threads exist: their destructors return
