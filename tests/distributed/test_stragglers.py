"""A straggler named in the step log, on real gloo ranks through the Engine.

Rank 1 sleeps before its second step's backward (a node stopped for a moment): rank 0
waits in the data-parallel all-reduce, its heartbeat thread reads rank 1's heartbeat
(``meshtrain.distributed.stragglers``), which shows that rank 1 has not entered that
collective, and the step's facts and its warning line name rank 1. Training goes on: the
third step runs. Nothing asserts a wall-clock figure; the wait is printed.
"""

from __future__ import annotations

from meshtrain.launch.processes import run_on_ranks

SLEEP_S = 5.0  # over the 2 s threshold (two beats of 1 s at the default timeout)


def _job() -> dict:
    import logging
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    import meshtrain

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("meshtrain").addHandler(Keep(logging.WARNING))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "distributed": {"backend": "gloo"},
    }
    torch.manual_seed(0)
    engine, *_ = meshtrain.initialize(model=nn.Linear(4, 1), config=config)
    rank = dist.get_rank()
    facts = []
    for step in range(3):
        loss = engine(torch.ones(2, 4)).sum()
        if step == 1 and rank == 1:
            time.sleep(SLEEP_S)
        engine.backward(loss)
        engine.step()
        facts.append(engine.log.last.get("stragglers", []))
    return {"rank": rank, "facts": facts, "lines": lines, "steps": engine.global_steps}


def test_a_stopped_rank_is_named_as_the_straggler_and_training_goes_on() -> None:
    rank0, rank1 = run_on_ranks(_job, 2, timeout=240.0)
    assert rank0["steps"] == rank1["steps"] == 3
    events = rank0["facts"][1]
    assert events, rank0
    print(events)
    late = [r for e in events for r in e["late"]]
    assert [r["rank"] for r in late] == [1], events
    assert late[0]["why"].startswith("had not entered it after"), late
    event = next(e for e in events if e["late"])
    assert event["group"] in ("dp", "world") and event["op"] == "all_reduce", event
    said = [ln for ln in rank0["lines"] if ln.startswith("step 2: straggler: waited ")]
    assert said and f" #{event['seq']} on the {event['group']} group for rank 1 (node" in said[0]
    # rank 1 waited for nobody on that step: it was the late one
    assert rank1["facts"][1] == [], rank1
