"""Trainer + pipeline parallelism (``mesh={"pipeline_parallel_size": 2}``) equals one
process, at pp 2 (2 processes, ZeRO 1's code path) and at pp 2 x dp 2 with ZeRO 2 (4
processes).

Two models, each run once per mesh in one process group:

* seed 000's shape: a BERT sentence classifier with a tokenizer, padded reviews, 18 rows of 4 per device with gradient accumulation 3, so each epoch's windows are [4, 4, 4] and
  a short [4, 2] (the pipeline runs 3, then 2 micro-batches, weighted 4/6 and 2/6 rather
  than 1/2 each); evaluation each epoch on 11 rows in batches of 4 (an uneven tail);
  checkpoints every 2 steps;
* a Llama causal LM on rows of 3..12 tokens: the label tokens of a micro-batch depend on
  its padding, so the window's loss is normalised by tokens, not micro-batches. It
  predicts in batches of one row (``test_loss`` is a mean of per-batch losses weighted by
  rows, so it depends on how rows are batched: one process and dp 2 batch differently).

At pp 2 only (with their one-process references), in the same process groups:

* a GPT-2 LM whose input embedding and LM head are one tensor on the first and the last
  stage, with ``gradient_checkpointing=True``, cut into 4 stages run as interleaved
  virtual stages (``pipeline.schedule`` interleaved_1f1b, ``virtual_stages`` 2 through
  ``deepspeed=``), evaluated in batches of 3 while training in batches of 2 (padded LM
  rows: the logits of padding positions are compared too), then ``save_model`` and
  ``GPT2LMHeadModel.from_pretrained``: the reloaded model equals the user's model exactly
  and one process's within 1e-5, and keeps the tie; every block of both of a rank's
  stages is checkpointed;
* a Qwen2 sequence classifier on right-padded rows with an attention mask (the head pools
  each row's last non-padding token), evaluation batch 3 vs training batch 2.

The bytes ``restore_user_model`` moves are asserted exactly (comm stats, every pp run):
rank r receives the user model's state-dict bytes minus those its stages hold, and sends
what the other stage's rank of its replica receives. ``save_model`` after ``train()``
moves nothing: rank 0 writes the handed-back user's model, whole on every rank already
(asserted for the GPT-2; the ``checkpoint-2`` exports during training are written from
the ranks, ``engine.save_weights``).

Against the one-process run on the same rows per step (pp 2 x dp 2 halves the rows per
device; the loader deals rows to replicas in turn, and the loss is normalised over the
window's label items of both replicas):

The BERT of pp 2 x dp 2 is compared with the same run at dp 2 without pp: the first
steps' gradients are near zero (the classifier starts at ln 2), so one process's sum over
4 rows and dp 2's average of two 2-row sums differ by ~1e-7 relative, which Adam's
m / sqrt(v) turns into whole learning-rate steps on entries near zero: 2e-5 in step 4's
loss between one process and dp 2, without pp as well. The Llama's are not near zero.

Tolerances (``tests/tolerance.py``), each model at its own learning rate (AdamW at the
BERT's 5e-3 and the Llama's and Qwen2's 1e-3, the GPT-2's SGD at 0.05 through
``sgd_rate``) over its logged steps (``trajectory``, peak rate every step):

* every logged training loss and the eval losses within that bound (fp32, no dropout: the
  same operations, split over two processes; ZeRO 2 reduce-scatters where one process
  sums locally: the same sums in another order);
* ``evaluate()``'s loss within it and its accuracy equal; ``predict()`` predictions (the
  last stage's logits, broadcast over the pp group) within ``composed`` of it (16 linear
  maps of weights within the bound), with exactly the dataset's rows and label_ids equal;
  the Llama also predicts a single row (at dp 2 one replica has none);
* the user's model object after ``train()`` holds the whole trained weights on every
  rank (the split had freed the other stage's blocks): normwise within the bound, each
  tensor within ``per_tensor`` of it (not elementwise: AdamW's 1/sqrt(v) enlarges ~1e-7
  gradient differences on near-zero entries), and seed 000's closing
  ``pipeline("text-classification", ...)`` answers as the one-process model (scores
  within ``composed``); the ``save_pretrained`` export in ``checkpoint-2`` as the weights;
* resume under pp 2: a new Trainer resumed from ``checkpoint-2`` logs the same losses for
  the remaining steps as the uninterrupted run, exactly (the same mesh: RNG, data
  position, optimizer and schedule restored bit for bit);
* seed 003's passthrough ``compute_loss`` override at pp 2 logs the plain run's losses
  exactly, and a ``compute_loss_func`` computing the same mean within the bound (they run
  per micro-batch on the last stage; ``tests/trainer/test_pipeline_overrides.py`` has the
  seed's own ``MyTrainer`` and ``BasicNet``); pp x tp: test_pipeline_tensor_parallel.py.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.harness import run_ranks
from tests.tolerance import check, check_weights, composed, relative, sgd_rate, trajectory
from tests.trainer.common import lm_rows, pad_collate
from tests.trainer.test_transformers_model import REVIEWS, _tokenizer


def _accuracy(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def _reviews(tok, n: int, shift: int = 0):
    rows = [REVIEWS[(i * 3 + shift) % len(REVIEWS)] for i in range(n)]
    return [{**tok(text + "很" * (i % 4)), "labels": y} for i, (text, y) in enumerate(rows)]


def _bert_trainer(tmp: str, tok, mesh, dp: int, deepspeed, cls=None, **kw):
    from transformers import DataCollatorWithPadding

    from meshtrain import Trainer, TrainingArguments
    from tests.tiny_models import tiny_bert

    model = tiny_bert(
        vocab_size=len(tok), hidden_size=32, num_attention_heads=2,
        intermediate_size=64, num_labels=2, attn_implementation=None,
    )  # fmt: skip
    args = TrainingArguments(
        f"{tmp}/bert", per_device_train_batch_size=4 // dp, gradient_accumulation_steps=3,
        per_device_eval_batch_size=4, num_train_epochs=2, learning_rate=5e-3,
        logging_steps=1, eval_strategy="epoch", save_strategy="steps", save_steps=2,
        disable_tqdm=True, mesh=mesh, deepspeed=deepspeed,
    )  # fmt: skip
    trainer = (cls or Trainer)(
        model=model, args=args, train_dataset=_reviews(tok, 18),
        eval_dataset=_reviews(tok, 11, shift=1), data_collator=DataCollatorWithPadding(tok),
        compute_metrics=_accuracy, **kw,
    )  # fmt: skip
    return model, trainer


def _classifier_results(trainer, metrics: dict, pred) -> dict:
    """What the classifier runs compare: logged losses, evaluations, metrics, predict()."""
    return {
        "losses": _losses(trainer),
        "evals": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
        "metrics": metrics,
        "predictions": pred.predictions,
        "label_ids": pred.label_ids,
        "test_loss": pred.metrics["test_loss"],
    }


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _bert(tmp: str, mesh, dp: int, deepspeed, resume: bool) -> dict:
    from safetensors.torch import load_file
    from transformers import pipeline

    tok = _tokenizer(tmp)
    model, trainer = _bert_trainer(tmp, tok, mesh, dp, deepspeed)
    whole = _state_bytes(model.state_dict(keep_vars=True).values())
    trainer.train()
    restore = _restore_bytes(trainer, whole) if mesh else None  # before save_model
    metrics = trainer.evaluate()
    pred = trainer.predict(_reviews(tok, 7, shift=2))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.config.id2label = {0: "差评!", 1: "好评!"}
    answer = pipeline("text-classification", model=model, tokenizer=tok)("我觉得不错!")
    out = {
        **_classifier_results(trainer, metrics, pred),
        "weights": weights,
        "answer": answer,
        "exported": load_file(f"{tmp}/bert/checkpoint-2/model.safetensors"),
        "restore": restore,
    }
    if resume:  # a new Trainer, from the checkpoint of step 2 (mid epoch 0)
        _, again = _bert_trainer(tmp, tok, mesh, dp, deepspeed)
        again.train(resume_from_checkpoint=f"{tmp}/bert/checkpoint-2")
        out["resumed"] = _losses(again)
    return out


def _llama(tmp: str, mesh, dp: int, deepspeed) -> dict:
    from meshtrain import Trainer, TrainingArguments
    from tests.tiny_models import tiny_llama

    args = TrainingArguments(
        f"{tmp}/llama", per_device_train_batch_size=4 // dp, gradient_accumulation_steps=2,
        per_device_eval_batch_size=1, num_train_epochs=2, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", disable_tqdm=True, mesh=mesh,
        deepspeed=deepspeed,
    )  # fmt: skip
    rows = [{"input_ids": r["input_ids"] % 64} for r in lm_rows(16, seed=4)]
    model = tiny_llama()
    whole = _state_bytes(model.state_dict(keep_vars=True).values())
    trainer = Trainer(model, args, train_dataset=rows, data_collator=pad_collate)
    trainer.train()
    pred = trainer.predict(rows[:5], ignore_keys=["past_key_values"])
    # fewer rows than data-parallel ranks: one replica evaluates nothing
    single = trainer.predict(rows[:1], ignore_keys=["past_key_values"])
    return {
        "single": single.predictions,
        "losses": _losses(trainer),
        "logits": pred.predictions,
        "test_loss": pred.metrics["test_loss"],
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "restore": _restore_bytes(trainer, whole) if mesh else None,
    }


def _state_bytes(tensors) -> int:
    """Bytes of the distinct tensors among ``tensors`` (a tied weight counted once)."""
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _restore_bytes(trainer, whole: int) -> dict:
    """What ``restore_user_model`` moved on this rank, beside what its theory needs: the
    user model's state-dict bytes (``whole``, measured before the split) minus those this
    rank's stages hold (``held``)."""
    stats = trainer.topology.stats
    return {
        "pp_rank": trainer.topology.pp_rank,
        "dp_rank": trainer.topology.dp_rank,
        "whole": whole,
        "held": _state_bytes(trainer.engine.module.state_dict(keep_vars=True).values()),
        "sent": stats.total(op="pp_restore_send"),
        "received": stats.total(op="pp_restore_recv"),
        "broadcast": stats.total(op="checkpoint"),
        "weights_sent": stats.total(op="save_weights_send"),
        "weights_received": stats.total(op="save_weights_recv"),
    }


def _lm_rows() -> list[dict]:
    return [{"input_ids": r["input_ids"] % 64} for r in lm_rows(14, seed=4)]


def _gpt2(tmp: str, mesh, deepspeed) -> dict:
    """A GPT-2 LM (input embedding tied to the LM head across the first and last stage)
    with gradient checkpointing, evaluated in batches of 3 (training: 2), saved with
    ``save_model`` and reloaded with ``from_pretrained``; under pp in interleaved
    virtual stages (4 blocks, 2 stages per rank)."""
    from transformers import GPT2LMHeadModel

    from meshtrain import Trainer, TrainingArguments
    from tests.tiny_models import tiny_gpt2

    args = TrainingArguments(
        f"{tmp}/gpt2", per_device_train_batch_size=2, gradient_accumulation_steps=3,
        per_device_eval_batch_size=3, num_train_epochs=2, learning_rate=0.05, optim="sgd",
        logging_steps=1, eval_strategy="epoch", save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=True, mesh=mesh, deepspeed=deepspeed,
    )  # fmt: skip
    rows = _lm_rows()
    model = tiny_gpt2(n_layer=4)
    whole = _state_bytes(model.state_dict(keep_vars=True).values())
    trainer = Trainer(model, args, train_dataset=rows, eval_dataset=rows[:7],
                      data_collator=pad_collate)  # fmt: skip
    trainer.train()
    pred = trainer.predict(rows[:5])
    trainer.save_model(f"{tmp}/gpt2/saved")
    reloaded = GPT2LMHeadModel.from_pretrained(f"{tmp}/gpt2/saved")
    stages = trainer.engine.module.stages.values() if mesh else ()
    return {
        "losses": _losses(trainer),
        "evals": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
        "logits": pred.predictions,
        "test_loss": pred.metrics["test_loss"],
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "reloaded": {k: v.detach().clone() for k, v in reloaded.state_dict().items()},
        "tied": model.lm_head.weight is model.transformer.wte.weight
        and reloaded.lm_head.weight is reloaded.transformer.wte.weight,
        "checkpointed": sum(getattr(m, "_meshtrain_checkpointed", False) for m in model.modules()),
        "local_blocks": sum(len(st.block_ids) for st in stages),
        "restore": _restore_bytes(trainer, whole) if mesh else None,
    }


def _cls_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 64, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g)
        rows.append({"input_ids": ids, "labels": int(ids.sum()) % 3})
    return rows


def _cls_collate(features: list[dict]) -> dict:
    """Right-padded with 0 (the model's pad_token_id) and an attention mask."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = f["input_ids"]
        mask[i, : len(f["input_ids"])] = 1
    labels = torch.tensor([f["labels"] for f in features])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _qwen2_classifier(tmp: str, mesh, deepspeed) -> dict:
    """A Qwen2 sequence classifier on padded rows (its head pools each row's last
    non-padding token, found in the real input_ids the last stage sees); eval batch 3,
    training batch 2."""
    import transformers

    from meshtrain import Trainer, TrainingArguments

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_labels=3, pad_token_id=0,
    )  # fmt: skip
    model = transformers.Qwen2ForSequenceClassification(config)
    whole = _state_bytes(model.state_dict(keep_vars=True).values())
    args = TrainingArguments(
        f"{tmp}/qwen2", per_device_train_batch_size=2, gradient_accumulation_steps=3,
        per_device_eval_batch_size=3, num_train_epochs=2, learning_rate=1e-3,
        logging_steps=1, eval_strategy="epoch", save_strategy="no", disable_tqdm=True,
        mesh=mesh, deepspeed=deepspeed,
    )  # fmt: skip
    trainer = Trainer(
        model, args, train_dataset=_cls_rows(14, 1), eval_dataset=_cls_rows(7, 2),
        data_collator=_cls_collate, compute_metrics=_accuracy,
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(_cls_rows(5, 3))
    return {
        **_classifier_results(trainer, metrics, pred),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "restore": _restore_bytes(trainer, whole) if mesh else None,
    }


def _overrides(tmp: str) -> list[list[float]]:
    """Seed 003's passthrough ``compute_loss`` override and a ``compute_loss_func`` (the
    model's mean loss) at pp 2: they run per micro-batch on the last stage
    (``trainer.pipeline_step``); their logged losses."""
    import torch.nn.functional as F

    from meshtrain import Trainer

    class MyTrainer(Trainer):  # seed 003's override
        def compute_loss(self, model, inputs, return_outputs=False):
            return super().compute_loss(model, inputs, return_outputs)

    def mean_ce(outputs, labels, num_items_in_batch=None):  # the window's share, as transformers
        n = labels.numel() if num_items_in_batch is None else num_items_in_batch  # evaluation
        return F.cross_entropy(outputs["logits"], labels, reduction="sum") / n

    tok = _tokenizer(tmp)
    mesh = {"pipeline_parallel_size": 2}
    out = []
    for i, (cls, kw) in enumerate(((MyTrainer, {}), (Trainer, {"compute_loss_func": mean_ce}))):
        _, trainer = _bert_trainer(f"{tmp}/override{i}", tok, mesh, 1, None, cls, **kw)
        trainer.train()
        out.append(_losses(trainer))
    return out


def _run(
    tmp: str,
    mesh,
    dp: int = 1,
    deepspeed=None,
    resume: bool = False,
    llama: bool = True,
    more: bool = False,
) -> dict:
    import os

    os.makedirs(tmp, exist_ok=True)
    out = {"bert": _bert(tmp, mesh, dp, deepspeed, resume)}
    if llama:
        out["llama"] = _llama(tmp, mesh, dp, deepspeed)
    if more:  # pp: interleaved virtual stages for the GPT-2
        interleaved = {"pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}
        out["gpt2"] = _gpt2(tmp, mesh, {**(deepspeed or {}), **interleaved} if mesh else None)
        if mesh:  # the V of zbv: the last stage, whose outputs evaluate() gathers, is on rank 0
            zbv = {"pipeline": {"schedule": "zbv", "virtual_stages": 2}}
            out["gpt2_zbv"] = _gpt2(f"{tmp}/zbv", mesh, {**(deepspeed or {}), **zbv})
        out["qwen2"] = _qwen2_classifier(tmp, mesh, deepspeed)
    if resume:
        out["overrides"] = _overrides(tmp)
    return out


ADAM = {"bert": 5e-3, "llama": 1e-3, "qwen2": 1e-3}  # the runs' AdamW learning rates


def _bound(name: str, want: dict) -> float:
    steps = len(want["losses"])
    if name == "gpt2":  # SGD at 0.05, no momentum
        numel = sum(t.numel() for t in want["weights"].values())
        return trajectory(sgd_rate(0.05, numel), steps)
    return trajectory(ADAM[name], steps)


def _close(what: str, a: dict, b: dict, bound: float) -> None:
    assert sorted(a) == sorted(b)
    check_weights(what, a, b, bound)


def _same_training(name: str, got: dict, want: dict) -> float:
    """Losses, the test loss and the weights within the run's bound; returns the bound."""
    bound = _bound(name, want)
    assert len(got["losses"]) == len(want["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        check(f"{name} loss {step}", abs(a - b) / abs(b), bound)
    check(
        f"{name} test loss",
        abs(got["test_loss"] - want["test_loss"]) / abs(want["test_loss"]),
        bound,
    )
    _close(name, got["weights"], want["weights"], bound)
    return bound


def _same_bert(b: dict, rb: dict) -> None:
    """The BERT runs agree (tolerances: module docstring)."""
    bound = _same_classifier("bert", b, rb, rows_labels=(7, 2))
    assert b["answer"][0]["label"] == rb["answer"][0]["label"]
    score, ref_score = b["answer"][0]["score"], rb["answer"][0]["score"]
    check("bert pipeline score", abs(score - ref_score) / ref_score, composed(bound, 16))
    _close("bert export", b["exported"], rb["exported"], bound)


def _same_llama(r: dict, ref: dict) -> None:
    """The Llama runs agree: losses, weights, and predict()'s logits over the vocabulary."""
    bound = _same_training("llama", r, ref)
    lg, rlg = r["logits"], ref["logits"]
    assert lg.shape == rlg.shape and lg.shape[0] == 5 and lg.shape[2] == 64
    check("llama logits", relative(lg, rlg), composed(bound, 16))
    assert r["single"].shape == ref["single"].shape and r["single"].shape[0] == 1
    check("llama single-row logits", relative(r["single"], ref["single"]), composed(bound, 16))


def _same_gpt2(g: dict, ref: dict) -> None:
    """The GPT-2 runs agree; the tie survives train(), save_model and from_pretrained."""
    bound = _same_training("gpt2", g, ref)
    for step, (x, y) in enumerate(zip(g["evals"], ref["evals"], strict=True)):
        check(f"gpt2 eval {step}", abs(x - y) / abs(y), bound)
    assert g["logits"].shape == ref["logits"].shape and g["logits"].shape[::2] == (5, 250)
    check("gpt2 logits", relative(g["logits"], ref["logits"]), composed(bound, 16))
    _close("gpt2 reloaded", g["reloaded"], ref["reloaded"], bound)
    assert sorted(g["reloaded"]) == sorted(g["weights"])
    for k, v in g["weights"].items():  # the reloaded model is the user's model exactly
        assert torch.equal(g["reloaded"][k], v), k
    assert g["tied"] and ref["tied"]


def _same_classifier(name: str, q: dict, ref: dict, rows_labels: tuple[int, int] = (5, 3)) -> float:
    """A classifier's runs agree: training, evaluations, metrics and predict()."""
    bound = _same_training(name, q, ref)
    for step, (x, y) in enumerate(zip(q["evals"], ref["evals"], strict=True)):
        check(f"{name} eval {step}", abs(x - y) / abs(y), bound)
    loss, ref_loss = q["metrics"]["eval_loss"], ref["metrics"]["eval_loss"]
    check(f"{name} eval_loss", abs(loss - ref_loss) / abs(ref_loss), bound)
    assert q["metrics"]["eval_accuracy"] == ref["metrics"]["eval_accuracy"]
    assert q["predictions"].shape == ref["predictions"].shape == rows_labels
    check(
        f"{name} predictions", relative(q["predictions"], ref["predictions"]), composed(bound, 16)
    )
    assert np.array_equal(q["label_ids"], ref["label_ids"])
    return bound


def _same_restore(runs: list[dict], name: str) -> None:
    """``restore_user_model`` moves exactly what each rank lacks, each tensor once from its
    owner: rank r receives the user model's bytes minus those its stages hold (a tied
    embedding both stages hold: not at all), and at pp 2 sends what the other stage's rank
    of its replica receives."""
    got = [r[name]["restore"] for r in runs]
    for b in got:
        assert b["received"] == b["whole"] - b["held"] > 0, (name, b)
        (other,) = [o for o in got if o["dp_rank"] == b["dp_rank"] and o is not b]
        assert b["sent"] == other["received"], (name, b, other)


def test_pipeline_trainer_equals_one_process(tmp_path):
    (ref,) = run_ranks(_run, 1, str(tmp_path / "one"), None, more=True)
    assert len(ref["bert"]["losses"]) == 4 and len(ref["llama"]["losses"]) == 4
    pp = {"pipeline_parallel_size": 2}
    zero1 = {"zero_optimization": {"stage": 1}}  # ZeRO 1 at dp 1: its path, no sharding
    pp2 = run_ranks(_run, 2, str(tmp_path / "pp2"), pp, 1, zero1, True, more=True)
    zero2 = {"zero_optimization": {"stage": 2}}
    pp2_dp2 = run_ranks(_run, 4, str(tmp_path / "pp2dp2"), pp, 2, zero2, timeout=600)
    (dp2, _) = run_ranks(_run, 2, str(tmp_path / "dp2"), None, 2, zero2, False, False)
    for r in pp2:
        _same_bert(r["bert"], ref["bert"])
        _same_llama(r["llama"], ref["llama"])
    for r in pp2_dp2:
        _same_bert(r["bert"], dp2["bert"])
        _same_llama(r["llama"], ref["llama"])
    assert ref["gpt2"]["checkpointed"] == 4  # every GPT-2 block checkpointed
    for r in pp2:
        _same_gpt2(r["gpt2"], ref["gpt2"])
        _same_gpt2(r["gpt2_zbv"], ref["gpt2"])
        _same_classifier("qwen2", r["qwen2"], ref["qwen2"])
        # interleaved: both of the rank's stages have their blocks checkpointed
        assert r["gpt2"]["checkpointed"] == r["gpt2"]["local_blocks"] == 2
        # save_model after train() writes the handed-back user's model from rank 0: it is
        # whole on every rank already, so nothing moves (no broadcast, no weights sent)
        b = r["gpt2"]["restore"]
        assert b["broadcast"] == b["weights_sent"] == b["weights_received"] == 0, b
    for name in ("bert", "llama", "gpt2", "qwen2"):
        _same_restore(pp2, name)
    for name in ("bert", "llama"):
        _same_restore(pp2_dp2, name)
    for r in pp2:
        # resumed at step 3 (after checkpoint-2): the remaining steps as uninterrupted
        assert r["bert"]["resumed"][-2:] == r["bert"]["losses"][2:]
        # the user's loss on the last stage: the passthrough override is the model's own
        # loss, bit for bit; compute_loss_func's mean equals it within the bound
        passthrough, func = r["overrides"]
        assert passthrough == r["bert"]["losses"][: len(passthrough)], r["overrides"]
        bound = trajectory(ADAM["bert"], len(func))
        for a, b in zip(func, passthrough, strict=True):
            check("bert pp2 compute_loss_func loss", abs(a - b) / abs(b), bound)
    # every rank's user model holds the same whole weights
    for runs in (pp2, pp2_dp2):
        for name in ("bert", "llama"):
            for k, v in runs[0][name]["weights"].items():
                assert all(torch.equal(v, r[name]["weights"][k]) for r in runs[1:]), k
