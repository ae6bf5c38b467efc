"""The files one batch enters, traced: docs/architecture.md's list is what runs.

One engine step (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``) at
ZeRO 2 and at ZeRO 3, on 2 real ranks, under ``sys.setprofile`` (and
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


def _documented() -> dict[int, set[str]]:
    """{stage: files} from the table between the traced-files markers."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- traced-files: begin -->")[1].split("<!-- traced-files: end -->")[0]
    out: dict[int, set[str]] = {2: set(), 3: set()}
    for line in table.splitlines():
        m = re.match(r"^\| `([^`]+)` \| (yes|-) \| (yes|-) \|", line)
        if m:
            for stage, mark in ((2, m.group(2)), (3, m.group(3))):
                if mark == "yes":
                    out[stage].add(m.group(1))
    return out


def _trace_one_step() -> dict[int, list[str]]:
    import threading

    import torch

    import meshtrain
    from tests.trainer.common import BasicNet

    src = str(Path(meshtrain.__file__).parent) + "/"
    out = {}
    for stage in (2, 3):
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = meshtrain.initialize(model=BasicNet(), config=config)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
        entered: set[str] = set()

        def profile(frame, event, arg, entered=entered):
            if event == "call" and frame.f_code.co_filename.startswith(src):
                entered.add(frame.f_code.co_filename[len(src) :])

        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            loss = engine(x).sum()
            engine.backward(loss)
            engine.step()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        assert engine.global_steps == 1
        out[stage] = sorted(entered)
    return out


def test_one_batch_enters_the_documented_files():
    documented = _documented()
    assert documented[2] and documented[3]
    for rank, traced in enumerate(run_ranks(_trace_one_step, 2, timeout=240)):
        for stage in (2, 3):
            seen = set(traced[stage])
            assert seen == documented[stage], (
                f"ZeRO {stage}, rank {rank}: entered but not in docs/architecture.md: "
                f"{sorted(seen - documented[stage])}; listed but not entered: "
                f"{sorted(documented[stage] - seen)}"
            )
