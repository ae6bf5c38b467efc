"""Seed 003's Trainer script on examples/trainer_mnist.py's data under meshtrain or
transformers; rank 0 prints eval_loss, steps and world size (docs/trainer.md, "Seed 003
against transformers"). Not a test (minutes per run):

    python tests/trainer/seed003_compare.py meshtrain 2          # notebook_launcher, 2
    python tests/trainer/seed003_compare.py transformers 2
    torchrun --nproc_per_node 2 tests/trainer/seed003_compare.py transformers direct
    USE_CPU=1 torchrun --nproc_per_node 2 tests/trainer/seed003_compare.py transformers direct
    python tests/trainer/seed003_compare.py meshtrain direct      # one process
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torch
import torch.nn.functional as F


def run(lib, seed_model=None):
    from mnist_setup import BasicNet
    from trainer_mnist import mnist_subset

    if lib == "meshtrain":
        from meshtrain import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    train_dset, test_dset = mnist_subset()
    model = BasicNet()
    kw = dict(
        per_device_train_batch_size=64,
        per_device_eval_batch_size=64,
        num_train_epochs=1,
        remove_unused_columns=False,
        report_to="none",
        save_strategy="no",
        label_names=["labels"],
    )
    kw["eval_strategy"] = "epoch"
    if lib == "transformers" and os.environ.get("USE_CPU"):
        kw["use_cpu"] = True
    args = TrainingArguments(f"seed003-{lib}", **kw)

    def collate_fn(examples):
        return {
            "x": torch.stack([e[0] for e in examples]),
            "labels": torch.tensor([e[1] for e in examples]),
        }

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            outputs = model(inputs["x"])
            loss = F.nll_loss(outputs, inputs["labels"])
            return (loss, outputs) if return_outputs else loss

    t = MyTrainer(
        model, args, train_dataset=train_dset, eval_dataset=test_dset, data_collator=collate_fn
    )
    t.train()
    ev = [h for h in t.state.log_history if "eval_loss" in h]
    tr = [h for h in t.state.log_history if "learning_rate" in h]
    if t.is_world_process_zero():
        print(
            lib,
            "RESULT",
            json.dumps(
                {
                    "eval": ev[-1]["eval_loss"],
                    "steps": t.state.global_step,
                    "world": int(os.environ.get("WORLD_SIZE", "1")),
                    "lr": [h.get("learning_rate") for h in tr],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    lib = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "direct":
        run(lib)
        sys.exit(0)
    if lib == "meshtrain":
        from meshtrain import notebook_launcher
    else:
        from accelerate import notebook_launcher
    notebook_launcher(run, args=(lib,), num_processes=int(sys.argv[2]) if len(sys.argv) > 2 else 2)
