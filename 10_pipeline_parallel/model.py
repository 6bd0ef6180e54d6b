"""The wine MLP every lesson from 01 to 10 trains (lesson 05 splits it over two devices): 13
measurements -> hidden units -> 3 cultivars. The same file in each of those lessons
(tests/test_repo.py checks it), so no lesson's diff shows it."""

import torch.nn.functional as F
from torch import nn


class WineMLP(nn.Module):
    """13 measurements -> 64 hidden units -> 3 cultivars. The names fc1 and fc2 are the
    checkpoint keys of every lesson, so any lesson's final.pt loads into this class.

    layers > 1 puts hidden x hidden layers between fc1 and fc2 (lesson 08's deeper MLP)."""

    def __init__(self, in_features=13, hidden=64, classes=3, layers=1):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers - 1))
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.fc2(x)
