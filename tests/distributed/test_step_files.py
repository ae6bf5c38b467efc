"""The files one batch enters, traced: docs/architecture.md's list is what runs.

One engine step (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``) at
ZeRO 2 and at ZeRO 3 (the test's own model), and with meshtrain's Decoder under a
warm-up schedule, at tp 2 and at cp 2 (ZeRO 1), on 2 real ranks, under ``sys.setprofile`` (and
``threading.setprofile`` for any thread the step starts): every Python function call is
seen, and the set of files under ``src/meshtrain/`` it enters must equal the table in
docs/architecture.md, both ways. No file is skipped; the model is the test's own (not a
meshtrain file), as a user's would be. Stage 3 runs with
``stage3_param_persistence_threshold: 0`` so the tiny model's parameters really are
partitioned (with the default every one of them would stay whole).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.harness import run_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


# the table's columns: (name, model, config) of one step each, on the same 2 ranks
COLUMNS = ("ZeRO 2", "ZeRO 3", "Decoder, warm-up", "tp 2", "cp 2")


def _documented() -> dict[str, set[str]]:
    """{column: files} from the table between the traced-files markers."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- traced-files: begin -->")[1].split("<!-- traced-files: end -->")[0]
    out: dict[str, set[str]] = {c: set() for c in COLUMNS}
    marks = r" \| ".join(["(yes|-)"] * len(COLUMNS))
    for line in table.splitlines():
        m = re.match(rf"^\| `([^`]+)` \| {marks} \|", line)
        if m:
            for i, column in enumerate(COLUMNS):
                if m.group(i + 2) == "yes":
                    out[column].add(m.group(1))
    return out


def _step(column: str):
    """The column's engine and one batch: BasicNet (the test's own model) at ZeRO 2 and
    3; meshtrain's Decoder at ZeRO 1 with WarmupLR, at tp 2, at cp 2."""
    import torch

    import meshtrain
    from tests.tiny_models import tiny_decoder
    from tests.trainer.common import BasicNet

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    g = torch.Generator().manual_seed(0)
    if column.startswith("ZeRO"):
        stage = int(column.split()[1])
        config["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
        engine, *_ = meshtrain.initialize(model=BasicNet(), config=config)
        return engine, (torch.randn(2, 8, generator=g),)
    config["zero_optimization"] = {"stage": 1}
    if column == "Decoder, warm-up":
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    elif column == "tp 2":
        config["mesh"] = {"tensor_parallel_size": 2}
    else:
        config["mesh"] = {"context_parallel_size": 2}
    engine, *_ = meshtrain.initialize(model=tiny_decoder(), config=config)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    return engine, (ids, ids)


def _trace_one_step() -> dict[str, list[str]]:
    import threading

    import meshtrain

    src = str(Path(meshtrain.__file__).parent) + "/"
    out = {}
    for column in COLUMNS:
        engine, batch = _step(column)
        entered: set[str] = set()

        def profile(frame, event, arg, entered=entered):
            if event == "call" and frame.f_code.co_filename.startswith(src):
                entered.add(frame.f_code.co_filename[len(src) :])

        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            loss = engine(*batch).sum()
            engine.backward(loss)
            engine.step()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        assert engine.global_steps == 1
        out[column] = sorted(entered)
    return out


def test_one_batch_enters_the_documented_files():
    documented = _documented()
    assert all(documented.values())
    for rank, traced in enumerate(run_ranks(_trace_one_step, 2, timeout=300)):
        for column in COLUMNS:
            seen = set(traced[column])
            assert seen == documented[column], (
                f"{column}, rank {rank}: entered but not in docs/architecture.md: "
                f"{sorted(seen - documented[column])}; listed but not entered: "
                f"{sorted(documented[column] - seen)}"
            )
