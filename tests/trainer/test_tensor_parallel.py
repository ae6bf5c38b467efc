"""Trainer + tensor parallelism (``mesh={"tensor_parallel_size": 2}``) equals one process,
at tp 2 (2 processes, dp 1) and at tp 2 x dp 2 (4 processes).

The tp 2 run reads the same batches as the one-process run; the tp 2 x dp 2 run halves
``per_device_train_batch_size`` so each step covers the same rows over its two
data-parallel ranks (the loss is normalised by the label items of the whole step, so the
step is the same; evaluation uses batches of one row so ``eval_loss``, a mean weighted by
rows, does not depend on how rows are batched). Compared with the one-process run:

* every logged training loss and the eval losses within ``trajectory`` of the run's
  learning rates (``tests/tolerance.py``; fp32, no dropout): the sharded matmuls and the
  vocab-parallel cross-entropy sum the same products in another order (partial sums, then
  an all-reduce), which Adam's normalised update carries into the weights;
* the full weights after training, read from the user's own model object, which
  ``train()`` hands back with its original modules (no tensor-parallel layer left) holding
  the gathered, unpadded weights: normwise over the model within the same bound, each
  tensor within ``per_tensor`` of it (not elementwise: Adam's 1/sqrt(v) enlarges 1e-7
  gradient differences in near-zero entries);
* a Llama's ``predict()`` logits over the whole 64-token vocabulary: before ``train()``,
  gathered from the two vocab shards (one evaluation in another order, ``evaluation()``);
  after it, from the restored whole model (``composed``: 16 linear maps whose weights
  each agree to the Llama's bound). Greedy ``generate()`` on the user's Llama after
  ``train()`` gives the one-process run's tokens exactly (every rank runs the whole model
  alone: no collective). The ``save_pretrained`` export in its checkpoint holds the whole
  tensors (as the weights above);
* resume under tensor parallelism (tp 2): a new Trainer resumed from the step-3
  checkpoint (mid epoch 0) logs losses for steps 4..8 equal to the uninterrupted run's
  exactly (same mesh: RNG, data position, optimizer and schedule are restored bit for
  bit);
* a ``compute_loss_func`` over the logits (a next-token cross-entropy by hand) at tp 2
  gets the whole vocabulary (the shards gathered) and trains the Llama to the one-process
  run's loss within its bound;
* pipeline x tensor parallelism: ``tests/trainer/test_pipeline_tensor_parallel.py``.
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks
from tests.tolerance import check, check_weights, composed, evaluation, relative, trajectory
from tests.trainer.common import TINY, lm_rows, pad_collate


def _decoder(out: str, mesh: dict | None, dp: int, save: bool, **kw):
    from meshtrain import Trainer, TrainingArguments
    from meshtrain.models import Decoder

    args = TrainingArguments(
        out, per_device_train_batch_size=4 // dp, gradient_accumulation_steps=2,
        per_device_eval_batch_size=1, num_train_epochs=2, learning_rate=1e-3,
        logging_steps=1, eval_strategy="epoch", save_strategy="steps" if save else "no",
        save_steps=3, disable_tqdm=True, mesh=mesh,
    )  # fmt: skip
    model = Decoder(TINY)
    trainer = Trainer(
        model, args, train_dataset=lm_rows(32), eval_dataset=lm_rows(10, seed=3),
        data_collator=pad_collate,
    )  # fmt: skip
    trainer.train(**kw)
    hist = trainer.state.log_history
    losses = [h["loss"] for h in hist if "loss" in h]
    evals = [h["eval_loss"] for h in hist if "eval_loss" in h]
    return model, losses, evals


def next_token_loss(outputs, labels, num_items_in_batch=None):
    """A causal LM's loss by hand (a user's ``compute_loss_func``): cross-entropy summed over
    the next tokens, over the window's label tokens; it needs every vocabulary logit."""
    import torch.nn.functional as F

    logits = outputs.logits[:, :-1].flatten(0, 1).float()
    target = labels[:, 1:].flatten()
    total = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    return total / ((target != -100).sum() if num_items_in_batch is None else num_items_in_batch)


def _train(out: str, mesh: dict | None, dp: int = 1, resume: bool = False):
    from transformers import LlamaForCausalLM

    from meshtrain import Trainer, TrainingArguments
    from meshtrain.parallel.tensor.layers import ColumnParallelLinear
    from tests.tiny_models import tiny_llama

    model, losses, evals = _decoder(f"{out}/decoder", mesh, dp, save=resume)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    resumed = None
    if resume:  # a new Trainer, from the checkpoint of step 3
        at = f"{out}/decoder/checkpoint-3"
        _, resumed, _ = _decoder(f"{out}/decoder", mesh, dp, True, resume_from_checkpoint=at)
    results = {"losses": losses, "evals": evals, "resumed": resumed, "weights": weights}
    results["decoder_plain"] = not any("Parallel" in type(m).__name__ for m in model.modules())
    if dp > 1:
        return results  # tp x dp: the decoder run; the Llama checks below ran at tp 2
    # a transformers decoder: predictions over the whole vocabulary (64 over 2 shards)
    llama_args = TrainingArguments(
        f"{out}/llama", per_device_train_batch_size=4 // dp, max_steps=2, learning_rate=1e-3,
        save_strategy="steps", save_steps=2, disable_tqdm=True, mesh=mesh,
    )  # fmt: skip
    rows = [{"input_ids": r["input_ids"] % 64} for r in lm_rows(16, seed=4)]
    llama = tiny_llama()
    trainer = Trainer(llama, llama_args, train_dataset=rows, data_collator=pad_collate)
    keys = ["past_key_values"]
    sharded_logits = trainer.predict(rows[:6], ignore_keys=keys).predictions  # before train
    was_sharded = isinstance(llama.lm_head, ColumnParallelLinear)
    llama_loss = trainer.train().training_loss
    logits = trainer.predict(rows[:6], ignore_keys=keys).predictions
    plain = type(llama) is LlamaForCausalLM and not any(
        "Parallel" in type(m).__name__ for m in llama.modules()
    )
    llama_weights = {k: v.detach().clone() for k, v in llama.state_dict().items()}
    with torch.no_grad():
        prompt = torch.tensor([[5, 9, 17, 33, 41]])
        tokens = llama.generate(prompt, min_new_tokens=6, max_new_tokens=6, do_sample=False)
    from safetensors.torch import load_file

    exported = load_file(f"{out}/llama/checkpoint-2/model.safetensors")  # save_pretrained
    # compute_loss_func sees whole-vocabulary logits under tp (the vocab shards gathered)
    func_args = TrainingArguments(
        f"{out}/llama_func", per_device_train_batch_size=4 // dp, max_steps=2,
        learning_rate=1e-3, save_strategy="no", disable_tqdm=True, mesh=mesh,
    )  # fmt: skip
    func = Trainer(tiny_llama(), func_args, train_dataset=rows, data_collator=pad_collate,
                   compute_loss_func=next_token_loss)  # fmt: skip
    func_loss = func.train().training_loss
    return {
        "llama_func_loss": func_loss,
        **results,
        "llama_loss": llama_loss,
        "sharded_logits": sharded_logits,
        "was_sharded": was_sharded,
        "logits": logits,
        "plain": plain,
        "llama_weights": llama_weights,
        "tokens": tokens,
        "exported": exported,
    }


DECODER_TOL = trajectory([1e-3 * (1 - step / 8) for step in range(8)])  # 8 steps, linear decay
LLAMA_TOL = trajectory([1e-3, 5e-4])  # max_steps=2, linear decay


def _close(what: str, a: dict, b: dict, bound: float) -> None:
    assert sorted(a) == sorted(b)  # whole, unpadded tensors under the original names
    check_weights(what, a, b, bound)


def _losses_close(what: str, got: list, want: list, bound: float) -> None:
    assert len(got) == len(want), (what, got, want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        check(f"{what} {step}", abs(a - b) / abs(b), bound)


def test_tensor_parallel_equals_one_process(tmp_path):
    (ref,) = run_ranks(_train, 1, str(tmp_path / "one"), None)
    assert len(ref["losses"]) == 8 and len(ref["evals"]) == 2
    tp = {"tensor_parallel_size": 2}
    tp2 = run_ranks(_train, 2, str(tmp_path / "tp2"), tp, 1, True)
    tp2_dp2 = run_ranks(_train, 4, str(tmp_path / "tp2dp2"), tp, 2, timeout=600)
    for r in tp2 + tp2_dp2:
        _losses_close("loss", r["losses"], ref["losses"], DECODER_TOL)
        _losses_close("eval loss", r["evals"], ref["evals"], DECODER_TOL)
        _close("decoder", r["weights"], ref["weights"], DECODER_TOL)
        assert r["decoder_plain"]
    for r in tp2:
        _losses_close("llama loss", [r["llama_loss"]], [ref["llama_loss"]], LLAMA_TOL)
        # the user's loss over the gathered vocabulary: the model's own loss, within the bound
        _losses_close("llama compute_loss_func", [r["llama_func_loss"]], [ref["llama_loss"]],
                      LLAMA_TOL)  # fmt: skip
        assert r["was_sharded"] and r["plain"]
        _close("llama", r["llama_weights"], ref["llama_weights"], LLAMA_TOL)
        for key, bound in (("sharded_logits", evaluation()), ("logits", composed(LLAMA_TOL, 16))):
            assert r[key].shape == ref[key].shape == (6, 12, 64)
            check(key, relative(r[key], ref[key]), bound)
        assert r["tokens"].shape == (1, 11) and torch.equal(r["tokens"], ref["tokens"])
        _close("export", r["exported"], ref["exported"], LLAMA_TOL)
        # resumed at step 4 under tp 2: steps 4..8 exactly as uninterrupted
        assert len(r["resumed"]) >= 5 and r["resumed"][-5:] == r["losses"][3:]
