"""``include_for_metrics`` ("inputs", "loss") against transformers' Trainer on the same
model and rows: ``compute_metrics`` receives ``EvalPrediction.inputs`` (the main input,
padded across batches with -100) and ``.losses`` (each row's batch loss) in dataset order,
on 2 ranks at dp 2 and at pp 2, as transformers gives them in one process.

Evaluation only (the same weights on both sides), one row per batch so that a row's
batch loss is its own whatever the layout. Tolerances (``tests/tolerance.py``):
inputs and label_ids exactly; predictions and losses within ``evaluation()`` of the
largest value (the same fp32 forward on the same row, GEMMs blocked by other thread
counts and, at pp 2, cut into two stages)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.tiny_models import tiny_llama
from tests.tolerance import check, evaluation

pytest.importorskip("transformers")
ROWS = 7


def _rows() -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(ROWS):
        ids = torch.randint(1, 64, (4 + i % 3,), generator=g)
        out.append({"input_ids": ids})
    return out


def _collate(features):
    from tests.trainer.common import pad_collate

    return pad_collate(features)


def _evaluate(trainer_cls, args_cls, tmp: str, mesh: dict | None) -> dict:
    seen = {}

    def compute_metrics(p):
        seen.update(predictions=p.predictions, label_ids=p.label_ids, inputs=p.inputs,
                    losses=p.losses, items=len(tuple(p)))  # fmt: skip
        return {"rows": float(len(p.label_ids))}

    extra = {} if mesh is None else {"mesh": mesh}
    args = args_cls(
        tmp, per_device_eval_batch_size=1, include_for_metrics=["inputs", "loss"],
        report_to="none", disable_tqdm=True, **extra,
    )  # fmt: skip
    trainer = trainer_cls(
        model=tiny_llama(4), args=args, eval_dataset=_rows(), data_collator=_collate,
        compute_metrics=compute_metrics,
    )  # fmt: skip
    metrics = trainer.evaluate()
    return {"seen": seen, "loss": metrics["eval_loss"], "rows": metrics["eval_rows"]}


def meshtrain_evaluates(tmp: str, mesh: dict | None) -> dict:
    from meshtrain import Trainer, TrainingArguments

    return _evaluate(Trainer, TrainingArguments, tmp, mesh)


def transformers_evaluates(tmp: str) -> dict:
    """The peer, in a process of its own: its Trainer makes accelerate's process-wide
    state, which a test process must not keep (rank processes started later inherit it)."""
    import transformers

    return _evaluate(transformers.Trainer, transformers.TrainingArguments, tmp, None)


def test_include_for_metrics_as_transformers_gives_it(tmp_path):
    from meshtrain.launch.processes import run_on_ranks

    (peer,) = run_on_ranks(
        transformers_evaluates, 1, (str(tmp_path / "hf"),), setup_distributed=False, timeout=300
    )
    ref = peer["seen"]
    assert ref["items"] == 4 and ref["inputs"].shape[0] == ROWS
    bound = evaluation()
    for name, mesh in (("dp2", None), ("pp2", {"pipeline_parallel_size": 2})):
        runs = run_ranks(meshtrain_evaluates, 2, str(tmp_path / name), mesh, timeout=400)
        for r in runs:
            got = r["seen"]
            assert r["rows"] == ROWS and got["items"] == 4, (name, got["items"])
            assert np.array_equal(got["inputs"], ref["inputs"]), name
            assert np.array_equal(got["label_ids"], ref["label_ids"]), name
            for key in ("predictions", "losses"):
                a, b = got[key], ref[key]
                assert a.shape == b.shape, (name, key, a.shape, b.shape)
                check(f"{name} {key}", float(np.abs(a - b).max() / np.abs(b).max()), bound)
