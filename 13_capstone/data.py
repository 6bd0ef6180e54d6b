"""The text every lesson from 11 on trains its tiny GPT on: lines of sums ("3+4=7"), a character
at a time, made in code. The same file in each of those lessons (tests/test_repo.py checks it),
so no lesson's diff shows it."""

import random

import torch
from torch.utils.data import TensorDataset

VOCAB = "0123456789+=\n"  # every character the text holds


def make_text(lines, seed):
    """lines of "a+b=c" with a and b from 0 to 9: text every learner has, made here, the same
    on every machine and every Python (a corpus shipped with Python changes between versions)."""
    pick = random.Random(seed)
    return "".join(f"{a}+{b}={a + b}\n" for a, b in
                   ((pick.randrange(10), pick.randrange(10)) for _ in range(lines)))


def load_data(seq_len):
    """Training and validation sequences of seq_len characters, each with its targets (the
    characters that follow, one on), cut from two texts of the same sums in different random
    orders; the same in every lesson run."""
    def windows(text):
        ids = torch.tensor([VOCAB.index(c) for c in text])
        count = (len(ids) - 1) // seq_len
        cut = ids[:count * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # [count, seq_len + 1]
        return TensorDataset(cut[:, :-1], cut[:, 1:])  # (inputs, targets) pairs

    return windows(make_text(4000, seed=0)), windows(make_text(400, seed=1))
