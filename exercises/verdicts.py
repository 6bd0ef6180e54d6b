"""What every check of exercises/check.py shares: its two verdicts other than PASS, the
tolerance, how a check points at a lesson's README, a free port, a rank's file, and, for the
checks of a module, the module and its functions' calls."""

import importlib.util
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


def load_beside(script, name):
    """Your module `name` (ring_attention.py, experts.py, split_backward.py), the file beside
    the script named on the command line."""
    path = os.path.join(os.path.dirname(os.path.abspath(script)), name)
    if not os.path.isfile(path):
        raise Unchecked(f"there is no {name} beside {script}")
    spec = importlib.util.spec_from_file_location(f"your_{name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 (any error of the learner's file is one line)
        raise Unchecked(f"your {name} failed to import: {error!r}") from None
    return module


def call(what, fn, *args):
    """fn(*args), or one line naming what raised and its error."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001
        said = f": {error}" if str(error) else ""
        raise Unchecked(f"{what} raised {type(error).__name__}{said}") from None


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
