"""A transformers BERT through the Trainer on 2 ranks: ZeRO-3 and tensor parallelism (tp 2)
equal ZeRO-0, the user's model holds the full trained weights afterwards (under tensor
parallelism: its original modules again, no tensor-parallel layer left), seed 000's
closing pipeline works on it, and ``trainer.save_model()`` writes what ``from_pretrained``
loads (the same logits, exactly: the same fp32 weights in the same model). A one-row
evaluation during training (fewer rows than ranks: rank 1 has none) gives the same loss
under every layout.

The tp 2 run has one data-parallel rank, so it reads 8 rows per device where ZeRO-0
reads 4 on each of 2 ranks: the same rows per step (the loader deals rows to ranks in
turn), and the loss is normalised by the step's label items either way.

Tolerances (``tests/tolerance.py``): logged losses, eval losses and the weights (normwise,
each tensor within ``per_tensor``) within ``trajectory`` of the run's learning rates
(5e-3 decaying linearly over 8 steps; fp32, dropout off; ZeRO-3 reduce-scatters where
stage 0 all-reduces: the same sums in another order, which AdamW's division by sqrt(v)
carries into the weights); the attention key biases, whose exact gradient is zero, within
``2 sum(lr)`` elementwise (``check_weights``' ``noise``). The best checkpoint's logits against the user's model, which
holds the same weights: ``evaluation()``.
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks
from tests.tolerance import check, check_weights, evaluation, relative, trajectory

CHARS = list("我觉得不错很好差评酒店服务房间干净价格便宜太贵了失望推荐满意")
REVIEWS = [
    ("我觉得不错", 1), ("很好推荐", 1), ("房间干净满意", 1), ("价格便宜很好", 1),
    ("太差了失望", 0), ("服务差评", 0), ("太贵了不好", 0), ("房间不干净", 0),
]  # fmt: skip


def _tokenizer(tmp: str):
    from transformers import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(CHARS)]
    import os

    # one file per process: both ranks build the tokenizer, and a shared file could be
    # truncated by one rank's open("w") while the other reads it
    path = f"{tmp}/vocab-{os.getpid()}.txt"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizer(path)


def _data(tokenizer, n: int):
    rows = [REVIEWS[i % len(REVIEWS)] for i in range(n)]
    return [{**tokenizer(text, max_length=16, truncation=True), "labels": y} for text, y in rows]


def _bert(tokenizer):
    from tests.tiny_models import tiny_bert

    return tiny_bert(
        vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2,
        intermediate_size=64, num_labels=2, attn_implementation=None,
    )  # fmt: skip


def _run(tmp: str):
    import os

    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, pipeline

    from meshtrain import Trainer, TrainerCallback, TrainingArguments

    tok = _tokenizer(tmp)
    out = {}

    class EvalOneRow(TrainerCallback):  # mid-training, under ZeRO-3 too: rank 1 has no row
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.metrics = self.trainer.evaluate(_data(tok, 1))

    for stage in (0, 3, "tp"):
        model = _bert(tok)
        tp = stage == "tp"  # ZeRO 0 on one data-parallel rank: twice the rows per device
        zero = {"stage": 0 if tp else stage}
        if stage == 3:  # every parameter gathered in the forward (by default the tiny
            zero["stage3_param_persistence_threshold"] = 0  # BERT's all stay whole)
        args = TrainingArguments(
            f"{tmp}/z{stage}",
            per_device_train_batch_size=8 if tp else 4,
            per_device_eval_batch_size=5,
            num_train_epochs=2,
            learning_rate=5e-3,
            logging_steps=1,
            eval_strategy="epoch",
            save_strategy="epoch",
            save_total_limit=1,
            metric_for_best_model="accuracy",
            load_best_model_at_end=True,
            deepspeed={"zero_optimization": zero},
            mesh={"tensor_parallel_size": 2} if tp else None,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=_data(tok, 32), eval_dataset=_data(tok, 11),
            data_collator=DataCollatorWithPadding(tok),
            compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
        )  # fmt: skip
        one_row = EvalOneRow()
        one_row.trainer = trainer
        trainer.add_callback(one_row)
        trainer.train()
        plain = not any("Parallel" in type(m).__name__ for m in model.modules())
        metrics = trainer.evaluate()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.config.id2label = {0: "差评!", 1: "好评!"}
        pipe = pipeline("text-classification", model=model, tokenizer=tok)
        answer = pipe("我觉得不错!")
        best = trainer.state.best_model_checkpoint
        kept = sorted(d for d in os.listdir(f"{tmp}/z{stage}") if d.startswith("checkpoint-"))
        exported = AutoModelForSequenceClassification.from_pretrained(best)
        trainer.save_model(f"{tmp}/final{stage}")  # collective: every rank calls it
        final = AutoModelForSequenceClassification.from_pretrained(f"{tmp}/final{stage}")
        batch = DataCollatorWithPadding(tok)(_data(tok, 8))
        batch.pop("labels")
        with torch.no_grad():
            mine = model(**batch).logits
            same = relative(exported(**batch).logits, mine) <= evaluation()
            same = same and torch.equal(final(**batch).logits, mine)
        same = same and os.path.isfile(f"{tmp}/final{stage}/training_args.json")
        out[stage] = (losses, weights, metrics, answer, kept, best, same and plain)
        out[f"one_row_{stage}"] = one_row.metrics["eval_loss"]
    return out


STEPS = 8  # logged steps: 2 epochs, 8 rows a step
RATES = [5e-3 * (1 - step / STEPS) for step in range(STEPS)]  # linear decay
TOL = trajectory(RATES)
# BERT's attention key biases have an exactly zero gradient (softmax ignores a shift of
# every score): trained on rounding noise only (tests/tolerance.check_weights)
KEY_BIAS = ("attention.self.key.bias",)


def _losses(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        check(f"{what} {step}", abs(a - b) / abs(b), TOL)


def test_zero3_bert_pipeline_and_exports(tmp_path):
    ranks = run_ranks(_run, 2, str(tmp_path))
    for out in ranks:
        (l0, w0, m0, a0, kept0, best0, same0), (l3, w3, m3, a3, _kept3, _best3, same3) = (
            out[0],
            out[3],
        )
        assert len(l0) == STEPS
        _losses(l3, l0, "stage 3")
        assert sorted(w3) == sorted(w0)
        check_weights("stage 3", w3, w0, TOL, noise=KEY_BIAS, lr_sum=sum(RATES))
        _losses([m3["eval_loss"]], [m0["eval_loss"]], "stage 3 eval")
        # a one-row evaluation at step 1 (rank 1 evaluates nothing; under ZeRO-3 it still
        # runs the forward's collectives, on row 0)
        _losses([out["one_row_3"], out["one_row_tp"]], [out["one_row_0"]] * 2, "one-row eval")
        assert a0[0]["label"] in ("差评!", "好评!") and a3[0]["label"] == a0[0]["label"]
        # 2 epochs, limit 1: the best (with load_best_model_at_end) and the newest survive
        assert best0.endswith(kept0[0]) or best0.endswith(kept0[-1])
        assert len(kept0) <= 2 and same0 and same3
        # tensor parallel (tp 2, dp 1, 8 rows per device: the same rows per step as
        # stage 0's 2 x 4) equals stage 0; the user's model is whole and plain again
        lt, wt, mt, at, _kept, _best, same_t = out["tp"]
        _losses(lt, l0, "tp")
        assert sorted(wt) == sorted(w0)
        check_weights("tp", wt, w0, TOL, noise=KEY_BIAS, lr_sum=sum(RATES))
        _losses([mt["eval_loss"]], [m0["eval_loss"]], "tp eval")
        assert at[0]["label"] == a0[0]["label"] and same_t
    # every rank holds the same full weights
    for stage in (3, "tp"):
        for k in ranks[0][stage][1]:
            assert torch.equal(ranks[0][stage][1][k], ranks[1][stage][1][k])
