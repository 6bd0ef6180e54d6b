"""What every check of exercises/check.py shares: its two verdicts other than PASS, the
tolerance, how a check points at a lesson's README, a free port, and a rank's file."""

import os
import socket

import torch

TOLERANCE = 1e-5  # on weights and losses: a correct rewrite adds or drops no more than rounding


class Unchecked(Exception):
    """The script could not be checked: one line says why (exit status 2)."""


class Mistake(Exception):
    """The script runs but differs from the lesson: what was seen, the likely mistake, where."""

    def __init__(self, seen, mistake, where):
        super().__init__(seen)
        self.seen, self.mistake, self.where = seen, mistake, where


def readme(lesson, anchor):
    return f"{lesson}/README.md#{anchor}"


def same(tensors, others):
    """Equal within TOLERANCE, tensor by tensor."""
    return len(tensors) == len(others) and all(
        torch.allclose(a, b, rtol=0, atol=TOLERANCE)
        for a, b in zip(tensors, others, strict=True))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read(path):
    """A rank's file, or "" where it wrote none."""
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        return f.read()
