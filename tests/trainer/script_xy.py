"""A seed-003-shaped Trainer script for the launch tests: prints one RESULT line per rank."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch.nn.functional as F

from meshtrain import Trainer, TrainingArguments
from tests.trainer.common import BasicNet, xy_collate, xy_rows


class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):
        outputs = model(inputs["x"])
        loss = F.nll_loss(outputs, inputs["labels"])
        return (loss, outputs) if return_outputs else loss


args = TrainingArguments(
    sys.argv[1], per_device_train_batch_size=8, num_train_epochs=1, evaluation_strategy="epoch",
    remove_unused_columns=False, save_strategy="no", learning_rate=1e-2, disable_tqdm=True,
)  # fmt: skip
trainer = MyTrainer(
    BasicNet(), args, train_dataset=xy_rows(32), eval_dataset=xy_rows(9, seed=2),
    data_collator=xy_collate,
)  # fmt: skip
out = trainer.train()
metrics = trainer.evaluate()
result = {"rank": int(os.environ.get("RANK", 0)), "steps": out.global_step,
          "eval_loss": metrics["eval_loss"]}  # fmt: skip
# one write per line: under PYTHONUNBUFFERED print() writes the text and the newline
# separately, and the two ranks' lines can interleave on the shared stdout
sys.stdout.write("RESULT " + json.dumps(result) + "\n")
sys.stdout.flush()
