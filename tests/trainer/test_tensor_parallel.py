"""Trainer + tensor parallelism (``mesh={"tensor_parallel_size": 2}``) equals one process.

Two processes form one tensor-parallel group (dp 1), so both see the same batches as
the one-process run. Compared with it:

* every logged training loss and the eval loss within 1e-6 (fp32, no dropout): the
  sharded matmuls and the vocab-parallel cross-entropy sum the same products in another
  order (partial sums, then an all-reduce), ~1e-7 relative;
* the full weights after training (``engine.module_state_dict()``: unsharded, padding
  dropped) within 1e-5: Adam's 1/sqrt(v) enlarges 1e-7 gradient differences in
  near-zero entries (as in test_parity);
* ``predict()`` logits of a Llama without labels within 1e-5 of the one-process model's
  (a prediction of the whole vocabulary, gathered from the two vocab shards; the same
  1e-7 relative differences on logits of magnitude ~10), and the ``save_pretrained``
  export in its checkpoint holds the whole tensors, equal within 1e-5 (Adam, as above);
* pipeline parallelism is refused with a ConfigError naming the field and what to do.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.trainer.common import TINY, lm_rows, pad_collate


def _ids_only(features):
    return {"input_ids": pad_collate(features)["input_ids"]}


def _train(out: str, mesh: dict | None):
    from meshtrain import Trainer, TrainingArguments
    from meshtrain.models import Decoder
    from tests.tiny_models import tiny_llama

    args = TrainingArguments(
        out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=2, learning_rate=1e-3, logging_steps=1, eval_strategy="epoch",
        save_strategy="no", disable_tqdm=True, mesh=mesh,
    )  # fmt: skip
    trainer = Trainer(
        Decoder(TINY), args, train_dataset=lm_rows(32), eval_dataset=lm_rows(10, seed=3),
        data_collator=pad_collate,
    )  # fmt: skip
    trainer.train()
    hist = trainer.state.log_history
    losses = [h["loss"] for h in hist if "loss" in h]
    evals = [h["eval_loss"] for h in hist if "eval_loss" in h]
    weights = trainer.engine.module_state_dict()
    # a transformers decoder: predictions over the whole vocabulary (64 over 2 shards)
    llama_args = TrainingArguments(
        f"{out}/llama", per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
        save_strategy="steps", save_steps=2, disable_tqdm=True, mesh=mesh,
    )  # fmt: skip
    rows = [{"input_ids": r["input_ids"] % 64} for r in lm_rows(16, seed=4)]
    llama = Trainer(tiny_llama(), llama_args, train_dataset=rows, data_collator=pad_collate)
    llama_loss = llama.train().training_loss
    logits = llama.predict(rows[:6], ignore_keys=["past_key_values"]).predictions
    from safetensors.torch import load_file

    exported = load_file(f"{out}/llama/checkpoint-2/model.safetensors")  # save_pretrained
    return losses, evals, weights, llama_loss, logits, exported


def _pipeline_refused():
    from meshtrain import TrainingArguments
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="pipeline_parallel_size") as err:
        TrainingArguments("x", mesh={"pipeline_parallel_size": 2})
    return str(err.value)


def test_tensor_parallel_equals_one_process(tmp_path):
    ((ref_losses, ref_evals, ref_w, ref_llama, ref_logits, ref_export),) = run_ranks(
        _train, 1, str(tmp_path / "one"), None
    )
    results = run_ranks(_train, 2, str(tmp_path / "tp"), {"tensor_parallel_size": 2})
    assert len(ref_losses) == 8 and len(ref_evals) == 2
    for losses, evals, weights, llama_loss, logits, export in results:
        assert max(abs(a - b) for a, b in zip(ref_losses, losses, strict=True)) <= 1e-6
        assert max(abs(a - b) for a, b in zip(ref_evals, evals, strict=True)) <= 1e-6
        assert abs(ref_llama - llama_loss) <= 1e-6
        assert sorted(weights) == sorted(ref_w)
        for k, v in ref_w.items():
            assert torch.allclose(weights[k], v, atol=1e-5, rtol=0), k
        assert logits.shape == ref_logits.shape == (6, 12, 64)
        assert abs(logits - ref_logits).max() <= 1e-5
        assert sorted(export) == sorted(ref_export)  # whole, unpadded tensors
        for k, v in ref_export.items():
            assert torch.allclose(export[k], v, atol=1e-5, rtol=0), k


def test_pipeline_parallel_is_refused():
    message = _pipeline_refused()
    assert "engine.train_batch" in message
