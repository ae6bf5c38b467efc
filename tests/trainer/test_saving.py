"""``trainer.save_model()`` for the three kinds of model users hand the Trainer, and
evaluation of a decoder-family classifier whose outputs carry a key/value cache.

One rank (forked, so the test process never holds a process group):
* a peft LoRA Llama sequence classifier: ``evaluate``/``predict`` leave the cache out of
  the predictions (transformers' ``keys_to_ignore_at_inference``), and ``save_model``
  writes the adapter only, which plain ``PeftModel.from_pretrained`` loads to the same
  logits (exactly: the same fp32 weights run the same ops);
* seed 003's plain ``nn.Module``: ``model.safetensors`` loads into a fresh module with
  ``torch.equal`` weights.
"""

from __future__ import annotations

import os

import torch

from tests.harness import run_ranks


def _cls_rows(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 64, (6,), generator=g).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * 6, "labels": ids[0] % 2})
    return rows


def _llama_classifier():
    import transformers

    from tests.tiny_models import tiny_llama_config

    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=64, num_labels=2, pad_token_id=0)
    return transformers.LlamaForSequenceClassification(cfg)


def _run(tmp: str) -> dict:
    import torch.nn.functional as F
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from meshtrain import Trainer, TrainingArguments
    from tests.trainer.common import BasicNet, xy_collate, xy_rows

    out = {}
    lora = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(_llama_classifier(), lora)
    args = TrainingArguments(
        f"{tmp}/lora", per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
        report_to="none", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_cls_rows(8))
    trainer.train()
    pred = trainer.predict(_cls_rows(5))
    out["pred_shape"] = tuple(pred.predictions.shape)
    trainer.save_model(f"{tmp}/adapter")
    out["adapter_files"] = sorted(os.listdir(f"{tmp}/adapter"))
    loaded = PeftModel.from_pretrained(_llama_classifier(), f"{tmp}/adapter").eval()
    ids = torch.tensor([r["input_ids"] for r in _cls_rows(3)])
    with torch.no_grad():
        out["adapter_equal"] = torch.equal(
            loaded(input_ids=ids).logits, model(input_ids=ids).logits
        )

    class Plain(Trainer):  # seed 003's override: the model takes no labels
        def compute_loss(self, model, inputs, return_outputs=False):
            logits = model(inputs["x"])
            loss = F.nll_loss(logits, inputs["labels"])
            return (loss, logits) if return_outputs else loss

    net = BasicNet()
    args = TrainingArguments(
        f"{tmp}/plain", per_device_train_batch_size=4, max_steps=2, report_to="none",
        disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = Plain(net, args, train_dataset=xy_rows(8), data_collator=xy_collate)
    trainer.train()
    trainer.save_model()  # default: args.output_dir
    fresh = BasicNet(seed=1)
    fresh.load_state_dict(load_file(f"{tmp}/plain/model.safetensors"))
    out["plain_equal"] = all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), net.parameters(), strict=True)
    )
    out["plain_files"] = sorted(os.listdir(f"{tmp}/plain"))
    return out


def test_save_model_and_cache_free_predictions(tmp_path):
    (out,) = run_ranks(_run, 1, str(tmp_path))
    assert out["pred_shape"] == (5, 2)  # logits only: no key/value cache in predictions
    assert "adapter_model.safetensors" in out["adapter_files"]
    assert "adapter_config.json" in out["adapter_files"]
    assert "model.safetensors" not in out["adapter_files"]  # the adapter, not the base
    assert out["adapter_equal"]
    assert out["plain_equal"]
    assert {"model.safetensors", "training_args.json"} <= set(out["plain_files"])
