"""The Trainer with padding-free packing equals one process on padded rows.

Tiny transformers Llama (GQA, sdpa, fp32, no dropout) on 32 documents of 3..12 tokens,
8 documents per optimizer step, 4 AdamW steps:

* one process, padded rows (the reference: the documents one per row, -100 on padding);
* one process, transformers' own ``DataCollatorWithFlattening`` (one row per micro-batch);
* two processes (dp 2), ``DataCollatorWithFlattening`` with 4 documents per rank, and
  meshtrain's ``padding_free=True`` (TRL's name, no collator passed) with 2 documents per
  rank and gradient accumulation 2;
* two processes at pipeline parallelism 2 (``mesh={"pipeline_parallel_size": 2}``),
  ``DataCollatorWithFlattening``: each stage builds the packed mask from the batch's
  ``position_ids``;
* meshtrain's Decoder on ``PackedDataset`` rows (fixed 24-token rows, padded tails) at
  dp 2 and at pp 2 against one process on the same rows.

Every logged loss and the weights (normwise over the model, and each tensor within
``per_tensor`` of that) within ``trajectory`` of the run's learning rates (1e-2 decaying
linearly over 4 steps: 1.6e-5 relative; ``tests/tolerance.py``): the same per-token sums
in another order and blocking, which Adam's normalised update carries into the weights.
Not elementwise: Adam's 1/sqrt(v) turns ~1e-7 gradient differences on near-zero entries
into updates that differ by a visible fraction of lr (measured across kernels: up to
6.0e-6 absolute on single elements, while the model agrees to 7.8e-7). The loss
of a step is the sum over its label items divided by their count over every rank
(``num_items_in_batch``): packing drops the padding and adds one -100 per document, so
the counts are the same as padded rows'.
"""

from __future__ import annotations

import torch

from tests.distributed.training import max_rel_diff
from tests.harness import run_ranks
from tests.tolerance import check, per_tensor, trajectory

N_DOCS = 32
STEPS = 4
LR = 1e-2
RATES = [LR * (1 - step / STEPS) for step in range(STEPS)]  # transformers' linear decay
TOL = trajectory(RATES)


def _docs():
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(
                1, 64, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g
            )
        }
        for _ in range(N_DOCS)
    ]


def _padded(features):
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = labels[i, :n] = f["input_ids"]
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _train(out, collator, per_device, accumulation=1, model="llama", data=None, **kw):
    from meshtrain import Trainer, TrainingArguments
    from meshtrain.models import Decoder, DecoderConfig
    from tests.tiny_models import tiny_llama

    if model == "llama":
        net = tiny_llama(seed=3, attn_implementation="sdpa")
    else:
        net = Decoder(DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48,
                                    max_seq_len=32, seed=5))  # fmt: skip
    args = TrainingArguments(
        out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=STEPS, learning_rate=LR, logging_steps=1, save_strategy="no",
        disable_tqdm=True, **kw,
    )  # fmt: skip
    trainer = Trainer(net, args, train_dataset=data or _docs(), data_collator=collator)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _packed_rows():
    from meshtrain.data.packing import PackedDataset

    return PackedDataset(_docs(), 24)


def _one_process(tmp):
    from transformers import DataCollatorWithFlattening

    from meshtrain.data.packing import stack_rows

    padded = _train(f"{tmp}/a", _padded, 8)
    flat = _train(f"{tmp}/b", DataCollatorWithFlattening(), 8)
    rows = _train(f"{tmp}/c", stack_rows, 4, model="decoder", data=_packed_rows())
    return padded, flat, rows, len(_packed_rows())


def _two_processes(tmp):
    from transformers import DataCollatorWithFlattening

    from meshtrain.data.packing import stack_rows

    flat = _train(f"{tmp}/d", DataCollatorWithFlattening(), 4)
    free = _train(f"{tmp}/e", None, 2, accumulation=2, padding_free=True)
    pp = _train(f"{tmp}/f", DataCollatorWithFlattening(), 8, mesh={"pipeline_parallel_size": 2})
    rows = _train(f"{tmp}/g", stack_rows, 2, model="decoder", data=_packed_rows())
    pp_rows = _train(
        f"{tmp}/h", stack_rows, 4, model="decoder", data=_packed_rows(),
        mesh={"pipeline_parallel_size": 2},
    )  # fmt: skip
    return flat, free, pp, rows, pp_rows


def _close(what, a, b):
    assert len(a) == len(b) == STEPS, (a, b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        check(f"{what} loss at step {step}", abs(x - y) / abs(x), TOL)


def _weights_close(what, a, b):
    assert a.keys() == b.keys()
    check(f"{what} weights", max_rel_diff(b, a), TOL)
    numel = sum(v.numel() for v in a.values())
    for k, v in a.items():
        rel = float((v - b[k]).norm() / v.norm())
        check(f"{what} {k}", rel, per_tensor(TOL, numel, v.numel()))


def test_packed_trainer_equals_padded_rows_on_one_and_two_processes(tmp_path):
    ((padded, flat, rows, n_rows),) = run_ranks(_one_process, 1, str(tmp_path))
    (dp_flat, dp_free, pp, dp_rows, pp_rows), _ = run_ranks(_two_processes, 2, str(tmp_path))
    assert n_rows == 12  # 4 rows a step: the fourth step starts the second epoch
    runs = {"flat": flat, "dp_flat": dp_flat, "dp_free": dp_free, "pp": pp}
    for what, (losses, weights) in runs.items():
        _close(what, padded[0], losses)
        _weights_close(what, padded[1], weights)
    for what, (losses, weights) in {"dp_rows": dp_rows, "pp_rows": pp_rows}.items():
        _close(what, rows[0], losses)
        _weights_close(what, rows[1], weights)
    from tests.tiny_models import tiny_llama

    start = tiny_llama(seed=3).state_dict()
    assert all(not torch.equal(start[k], v) for k, v in padded[1].items() if "norm" not in k)
