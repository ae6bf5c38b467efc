"""``Trainer.save_model`` and ``checkpoint-N`` of a prompt-tuned / prefix-tuned peft model
under ZeRO-3, on 2 ranks.

peft's ``save_pretrained`` of a prompt-learning adapter runs the prompt encoder to get the
embeddings it saves; under ZeRO-3 the encoder's weights are shards and running it on the
writing rank alone is a gather on one rank, which hung. Every rank now computes those
embeddings together from whole weights, and rank 0 writes them. Asserted: neither save
hangs (the harness's timeout), both folders hold the adapter only, and
``PeftModel.from_pretrained`` on the base model gives the trained model's logits (within
``evaluation()`` of the largest logit, ``tests/tolerance.py``: the same fp32 weights, the
prompt embeddings computed once more in another batch).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import check, evaluation

pytest.importorskip("peft")

SEQ = 8


def _peft_config(method: str):
    import peft

    if method == "prompt":
        return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


def _ids(seed: int, rows: int) -> torch.Tensor:
    return torch.randint(0, 64, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def _run(out: str, method: str) -> dict:
    import os

    import peft
    import torch.distributed as dist

    from meshtrain import Trainer, TrainingArguments
    from tests.tiny_models import tiny_llama

    model = peft.get_peft_model(tiny_llama(0), _peft_config(method))
    rows = [{"input_ids": r, "labels": r} for r in _ids(0, 8).tolist()]
    args = TrainingArguments(
        os.path.join(out, method),
        per_device_train_batch_size=2,
        max_steps=2,
        save_steps=2,
        learning_rate=1e-2,
        report_to="none",
        disable_tqdm=True,
        deepspeed={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    )
    trainer = Trainer(model, args, train_dataset=rows)
    trainer.train()
    final = os.path.join(out, method, "final")
    trainer.save_model(final)
    dist.barrier()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.engine(input_ids=_ids(99, 2)).logits
    return {
        "final": final,
        "checkpoint": os.path.join(out, method, "checkpoint-2"),
        "logits": logits,
    }


@pytest.mark.parametrize("method", ["prompt", "prefix"])
def test_prompt_learning_saves_under_zero3(method, tmp_path):
    import peft
    from safetensors.torch import load_file

    from tests.tiny_models import tiny_llama

    got = run_ranks(_run, 2, str(tmp_path), method, timeout=300)[0]
    n_adapter = sum(
        p.numel()
        for p in peft.get_peft_model(tiny_llama(0), _peft_config(method)).parameters()
        if p.requires_grad
    )
    for folder in (got["final"], got["checkpoint"]):
        saved = load_file(f"{folder}/adapter_model.safetensors")
        assert list(saved) and all(v.numel() > 0 for v in saved.values()), folder
        if method == "prompt":  # the saved embeddings are the encoder's output, its size
            assert sum(v.numel() for v in saved.values()) == n_adapter, list(saved)
        reloaded = peft.PeftModel.from_pretrained(tiny_llama(0), folder).eval()
        with torch.no_grad():
            logits = reloaded(input_ids=_ids(99, 2)).logits
        bound = evaluation() * float(got["logits"].abs().max())
        check(f"{folder} logits", float((logits - got["logits"]).abs().max()), bound)
