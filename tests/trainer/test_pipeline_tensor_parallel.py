"""The Trainer at pipeline x tensor parallelism (``mesh={"pipeline_parallel_size": 2,
"tensor_parallel_size": 2}``, 4 processes) equals one process (issue 44).

A tiny Llama (2 blocks: one per stage, each block's attention and MLP split over the tp
pair, the embedding and LM head vocab-parallel) trains 3 steps of 2 micro-batches of 2
padded rows, then predicts 5 rows in batches of one. Against the one-process run on the
same rows:

* ``predict()`` before ``train()``, through the pipeline (the last stage's logits are
  vocab shards, gathered over the tp pair): within ``evaluation()`` of the largest logit;
* every logged training loss within ``trajectory`` of the rates (fp32: the sharded
  matmuls and the vocab-parallel cross-entropy sum in another order);
* after ``train()`` the user's own model object holds the whole trained weights on every
  rank (each rank first receives its tp rank's shards of the other stage's block, then
  the tp pair gathers): within ``check_weights`` of the one-process model; ``predict()``
  then runs it whole (``composed``: 16 maps of weights within the bound);
* ``compute_loss_func`` (the same mean of the model's loss, run per micro-batch on the last
  stage) logs the plain run's losses within the bound;
* the same with the labels under the user's own name (``label_names=["lm_labels"]``);
* a ``prediction_step`` override (calling the Trainer's, on the last stage) predicts what
  the plain Trainer predicts, exactly (the same forwards).
"""

from __future__ import annotations

import numpy as np
import torch

from tests.harness import run_ranks
from tests.tiny_models import tiny_llama
from tests.tolerance import check, check_weights, composed, evaluation, relative, trajectory
from tests.trainer.common import lm_rows, pad_collate

MESH = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}
LR = 1e-3
BOUND = trajectory([LR * (1 - s / 3) for s in range(3)])  # 3 steps, linear decay


def _rows() -> list[dict]:
    return [{"input_ids": r["input_ids"] % 64} for r in lm_rows(12, seed=4)]


def _named_labels(features):
    batch = pad_collate(features)
    batch["lm_labels"] = batch.pop("labels")
    return batch


def _trainer(tmp: str, mesh, cls=None, label_names=None, collator=pad_collate, **extra):
    from meshtrain import Trainer, TrainingArguments

    args = TrainingArguments(
        tmp, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=1, num_train_epochs=1, learning_rate=LR, logging_steps=1,
        save_strategy="no", disable_tqdm=True, report_to="none", label_names=label_names,
        **({} if mesh is None else {"mesh": mesh}),
    )  # fmt: skip
    model = tiny_llama(0)
    cls = cls or Trainer
    return model, cls(model, args, train_dataset=_rows(), data_collator=collator, **extra)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run(tmp: str, mesh) -> dict:
    from meshtrain import Trainer

    class Overridden(Trainer):  # the user's prediction_step, run on the last stage
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    _, user = _trainer(f"{tmp}/user", mesh, cls=Overridden)
    overridden = user.predict(_rows()[:5]).predictions
    model, trainer = _trainer(f"{tmp}/plain", mesh)
    before = trainer.predict(_rows()[:5]).predictions
    trainer.train()
    after = trainer.predict(_rows()[:5]).predictions
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def mean_loss(outputs, labels, num_items_in_batch=None):
        """The Llama's own loss, by hand: next-token cross-entropy summed over the
        micro-batch, over the window's label tokens (transformers' num_items_in_batch)."""
        import torch.nn.functional as F

        logits = outputs.logits[:, :-1].flatten(0, 1).float()
        target = labels[:, 1:].flatten()
        total = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        n = (target != -100).sum() if num_items_in_batch is None else num_items_in_batch
        return total / n

    _, with_func = _trainer(f"{tmp}/func", mesh, compute_loss_func=mean_loss)
    with_func.train()
    # the labels under the user's own name: popped for the user's loss, never fed forward
    _, named = _trainer(f"{tmp}/named", mesh, compute_loss_func=mean_loss,
                        label_names=["lm_labels"], collator=_named_labels)  # fmt: skip
    named.train()
    return {"before": before, "overridden": overridden, "losses": _losses(trainer), "weights": weights, "after": after,
            "func": _losses(with_func), "named": _losses(named)}  # fmt: skip


def test_trainer_at_pp2_tp2_equals_one_process(tmp_path):
    (ref,) = run_ranks(run, 1, str(tmp_path / "one"), None, timeout=400)
    runs = run_ranks(run, 4, str(tmp_path / "pptp"), MESH, timeout=900)
    assert len(ref["losses"]) == 3
    for rank, r in enumerate(runs):
        what = f"pp2 x tp2 rank {rank}"
        assert r["before"].shape == ref["before"].shape == (5, 12, 64), r["before"].shape
        check(f"{what} predict before train", relative(r["before"], ref["before"]), evaluation())
        assert np.array_equal(r["overridden"], r["before"]), what  # the same forwards
        assert len(r["losses"]) == len(r["func"]) == 3
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"], strict=True)):
            check(f"{what} loss {step}", abs(a - b) / abs(b), BOUND)
        for key in ("func", "named"):
            assert len(r[key]) == 3, (what, key)
            for step, (a, b) in enumerate(zip(r[key], ref["losses"], strict=True)):
                check(f"{what} compute_loss_func ({key}) loss {step}", abs(a - b) / abs(b), BOUND)
        assert r["weights"].keys() == ref["weights"].keys()
        for k, v in ref["weights"].items():
            assert r["weights"][k].shape == v.shape, (what, k)  # whole, not a tp shard
        check_weights(
            what, r["weights"], ref["weights"], BOUND, lr_sum=sum([LR, LR * 2 / 3, LR / 3])
        )
        check(
            f"{what} predict after train", relative(r["after"], ref["after"]), composed(BOUND, 16)
        )
    assert all(
        torch.equal(r["weights"][k], runs[0]["weights"][k]) for r in runs for k in ref["weights"]
    )
