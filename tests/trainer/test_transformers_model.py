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

Tolerances: logged losses within 1e-6 (fp32, dropout off; ZeRO-3 reduce-scatters where
stage 0 all-reduces: the same sums in another order); weights within 1e-5 (AdamW's
division by sqrt(v) enlarges ~1e-7 gradient differences on near-zero entries).
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks

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
            same = torch.allclose(exported(**batch).logits, mine, atol=1e-5)
            same = same and torch.equal(final(**batch).logits, mine)
        same = same and os.path.isfile(f"{tmp}/final{stage}/training_args.json")
        out[stage] = (losses, weights, metrics, answer, kept, best, same and plain)
        out[f"one_row_{stage}"] = one_row.metrics["eval_loss"]
    return out


def test_zero3_bert_pipeline_and_exports(tmp_path):
    ranks = run_ranks(_run, 2, str(tmp_path))
    for out in ranks:
        (l0, w0, m0, a0, kept0, best0, same0), (l3, w3, m3, a3, _kept3, _best3, same3) = (
            out[0],
            out[3],
        )
        assert len(l0) == 8 and max(abs(a - b) for a, b in zip(l0, l3, strict=True)) <= 1e-6
        for k in w0:
            assert torch.allclose(w0[k], w3[k], atol=1e-5, rtol=0), k
        assert abs(m0["eval_loss"] - m3["eval_loss"]) <= 1e-5
        # a one-row evaluation at step 1 (rank 1 evaluates nothing; under ZeRO-3 it still
        # runs the forward's collectives, on row 0)
        assert abs(out["one_row_0"] - out["one_row_3"]) <= 1e-5
        assert abs(out["one_row_0"] - out["one_row_tp"]) <= 1e-5
        assert a0[0]["label"] in ("差评!", "好评!") and a3[0]["label"] == a0[0]["label"]
        # 2 epochs, limit 1: the best (with load_best_model_at_end) and the newest survive
        assert best0.endswith(kept0[0]) or best0.endswith(kept0[-1])
        assert len(kept0) <= 2 and same0 and same3
        # tensor parallel (tp 2, dp 1, 8 rows per device: the same rows per step as
        # stage 0's 2 x 4) equals stage 0; the user's model is whole and plain again
        lt, wt, mt, at, _kept, _best, same_t = out["tp"]
        assert max(abs(a - b) for a, b in zip(l0, lt, strict=True)) <= 1e-6
        for k in w0:
            assert wt[k].shape == w0[k].shape and torch.allclose(w0[k], wt[k], atol=1e-5), k
        assert abs(m0["eval_loss"] - mt["eval_loss"]) <= 1e-5
        assert at[0]["label"] == a0[0]["label"] and same_t
    # every rank holds the same full weights
    for stage in (3, "tp"):
        for k in ranks[0][stage][1]:
            assert torch.equal(ranks[0][stage][1][k], ranks[1][stage][1][k])
