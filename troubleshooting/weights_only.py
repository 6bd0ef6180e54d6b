"""Troubleshooting: torch.load refuses a checkpoint ("Weights only load failed").

Since PyTorch 2.6, torch.load(path) means torch.load(path, weights_only=True): it unpickles only
tensors, plain containers and numbers, because unpickling anything else can run arbitrary code.
A checkpoint that holds anything else, here the argparse.Namespace of the run's flags (a common
habit), is refused. This writes such a checkpoint, shows the refusal, then two fixes.
See TROUBLESHOOTING.md.

    python troubleshooting/weights_only.py
"""

import argparse
import os
import re
import tempfile

import torch
from torch import nn


def main():
    with tempfile.TemporaryDirectory() as folder:
        demonstrate(os.path.join(folder, "checkpoint.pt"))


def demonstrate(path):
    model = nn.Linear(13, 3)
    args = argparse.Namespace(epochs=20, lr=0.01)

    torch.save({"model": model.state_dict(), "epochs_completed": 20, "args": args}, path)
    try:
        torch.load(path)
    except Exception as error:
        print(f"torch.load({os.path.basename(path)!r}) raised {type(error).__name__}:")
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # without the terminal's bold
        for line in text.splitlines():
            if "Weights only load failed" in line or "Unsupported global" in line:
                print(f"  {line.strip()}")
        print("symptom: the checkpoint holds an argparse.Namespace, which weights_only=True "
              "refuses")

    # Fix 1, for files you write from now on: keep only tensors and plain Python values.
    # vars(args) turns the Namespace into a dict of numbers and strings.
    torch.save({"model": model.state_dict(), "epochs_completed": 20, "args": vars(args)}, path)
    checkpoint = torch.load(path, weights_only=True)
    print(f"fix 1: saved vars(args) instead; weights_only=True loads it: args = "
          f"{checkpoint['args']}")

    # Fix 2, for a file you already have and trust (you wrote it): allow that one class.
    # weights_only=False would also load it, but it would run whatever the file asks for.
    torch.save({"model": model.state_dict(), "epochs_completed": 20, "args": args}, path)
    with torch.serialization.safe_globals([argparse.Namespace]):
        checkpoint = torch.load(path, weights_only=True)
    print(f"fix 2: safe_globals([argparse.Namespace]) loads the old file: args = "
          f"{checkpoint['args']}")


if __name__ == "__main__":
    main()
