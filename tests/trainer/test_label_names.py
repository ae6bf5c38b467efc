"""The Trainer's default ``label_names`` (transformers' ``find_labels`` rule: the model's
forward arguments named like a label, in signature order). They decide which column counts
the label items that weight each micro-batch, so they must not depend on the process:
they once came from a set, whose order follows each process's string hashing, and the
Decoder's ``shift_labels`` (context parallelism's keyword) then came first in some
processes, weighting micro-batches by rows instead of tokens (a run's loss changed from
one launch to the next)."""

from __future__ import annotations

import subprocess
import sys

from meshtrain.trainer.loss import forward_names

PROBE = """
from meshtrain import Trainer, TrainingArguments
from meshtrain.models import Decoder, DecoderConfig
model = Decoder(DecoderConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=32))
print(Trainer(model=model, args=TrainingArguments(output_dir="unused")).label_names)
"""


def test_decoder_label_names_are_labels_in_every_process():
    from meshtrain.models import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=32))
    names = forward_names(model)
    assert names[:2] == ("input_ids", "labels") and "shift_labels" in names
    seen = set()
    for seed in ("0", "1", "2", "3"):  # string hashing differs per seed
        out = subprocess.run(
            [sys.executable, "-c", PROBE],
            capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed, **_env()},
        )  # fmt: skip
        seen.add(out.stdout.strip().splitlines()[-1])
    assert seen == {"['labels']"}, seen


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
