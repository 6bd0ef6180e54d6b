"""The wine data every lesson from 01 to 10 trains on: scikit-learn's 178 wines, 13 chemical
measurements each, 3 cultivars to tell apart. The same file in each of those lessons
(tests/test_repo.py checks it), so no lesson's diff shows it."""

import torch
from torch.utils.data import Dataset


class WineDataset(Dataset):
    def __init__(self, features, labels):
        self.features = torch.as_tensor(features, dtype=torch.float32)
        self.labels = torch.as_tensor(labels, dtype=torch.long)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.features[index], self.labels[index]


def load_data():
    """The same 142 training and 36 test wines in every lesson."""
    # Imported here, where it is used: from lesson 02 on, the process that starts the ranks
    # loads no data, and so skips scikit-learn's import (about a second on a laptop).
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    features, labels = load_wine(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.2, random_state=42, stratify=labels
    )
    # Fit the scaler on the training part only: the test wines must not leak into training.
    scaler = StandardScaler().fit(x_train)
    return (
        WineDataset(scaler.transform(x_train), y_train),
        WineDataset(scaler.transform(x_test), y_test),
    )
