"""transformers' ``use_liger_kernel`` on meshtrain's TrainingArguments (issue 30): its
fused linear cross-entropy is meshtrain's chunked loss, so a user's flag keeps its memory
meaning; the other Liger kernels are said to do nothing.

One process, a tiny transformers Llama, 4 Trainer steps with and without the flag: the
logged losses agree within ``trajectory`` of the run's rates (``tests/tolerance.py``;
fp32; the chunked loss sums the same per-token terms in chunks, as in
``tests/loss/test_chunked_head.py``), and the
engine really ran the chunked head.
"""

from __future__ import annotations

import logging

import pytest
import torch

from meshtrain import TrainingArguments
from meshtrain.errors import ConfigError
from tests.harness import run_ranks
from tests.tolerance import check, trajectory


def _train(tmp: str, liger: bool):
    from meshtrain import Trainer
    from tests.tiny_models import tiny_llama

    model = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 12), generator=g)
    ]
    args = TrainingArguments(
        output_dir=f"{tmp}/{liger}", per_device_train_batch_size=4, max_steps=4,
        logging_steps=1, save_strategy="no", learning_rate=1e-3, report_to="none",
        use_liger_kernel=liger, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    # the chunked head replaces the LM head's forward on the instance
    patched = "forward" in vars(trainer.engine.module.lm_head)
    return losses, trainer.engine.config.loss.chunked, patched


def _both(tmp: str):
    return _train(tmp, False), _train(tmp, True)


def test_use_liger_kernel_is_the_chunked_loss(tmp_path):
    (plain, off, unpatched), (liger, on, patched) = run_ranks(_both, 1, str(tmp_path))[0]
    assert off is False and on is True
    assert patched and not unpatched
    assert len(plain) == len(liger) == 4
    bound = trajectory([1e-3 * (1 - step / 4) for step in range(4)])  # 4 steps, linear decay
    for step, (a, b) in enumerate(zip(plain, liger, strict=True)):
        check(f"loss {step}", abs(a - b) / abs(a), bound)


def test_liger_kernel_config_says_what_does_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        args = TrainingArguments(
            output_dir="unused", use_liger_kernel=True,
            liger_kernel_config={"rope": True, "rms_norm": True, "fused_linear_cross_entropy": True},
        )  # fmt: skip
    assert "rms_norm, rope do nothing in meshtrain" in caplog.text
    assert args.to_engine_config()["loss"]["chunked"] is True
    off = TrainingArguments(
        output_dir="unused", use_liger_kernel=True,
        liger_kernel_config={"fused_linear_cross_entropy": False},
    )  # fmt: skip
    assert "loss" not in off.to_engine_config() or not off.to_engine_config()["loss"]["chunked"]
    with pytest.raises(ConfigError, match="liger_kernel_config"):
        TrainingArguments(output_dir="unused", liger_kernel_config={"rope": "yes"})
