"""The wine MLP of lessons 01 to 10, split over two devices: lesson 05's model parallelism. Its
layers and their names are the others' model.py's, so lesson 05's diff shows only the split."""

import torch
import torch.nn.functional as F
from torch import nn


class WineMLP(nn.Module):
    """13 measurements -> 64 hidden units -> 3 cultivars. The names fc1 and fc2 are the
    checkpoint keys of every lesson, so any lesson's final.pt loads into this class.

    Stage 1 (fc1 and its ReLU) lives on dev0, stage 2 (fc2) on dev1."""

    def __init__(self, dev0="cpu", dev1="cpu", in_features=13, hidden=64, classes=3):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        # Both are built on the CPU in lesson 02's order, then moved, so the same seed gives the
        # same weights anywhere.
        self.fc1 = nn.Linear(in_features, hidden).to(self.dev0)
        self.fc2 = nn.Linear(hidden, classes).to(self.dev1)

    def forward(self, x):
        hidden = F.relu(self.fc1(x.to(self.dev0)))
        # The one cost of the split: stage 1's activations are copied to stage 2's device here,
        # and in backward their gradient is copied back. Meanwhile the other device waits.
        return self.fc2(hidden.to(self.dev1))
