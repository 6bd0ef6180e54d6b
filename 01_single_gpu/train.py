"""Lesson 01: the baseline. One process trains a small MLP on one device.

The data (data.py) and the model (model.py) stay the same up to lesson 10, so every later lesson
changes how we train, not what: lesson 02's diff from this file is DDP, and nothing else.

Run it:
    python 01_single_gpu/train.py                      # CUDA if present, else the CPU
    python 01_single_gpu/train.py --device cpu         # force the CPU
    python 01_single_gpu/train.py --device cuda:1      # pick one GPU
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import guard_rails
from data import load_data
from model import WineMLP


# ---------------------------------------------------------------------------------------------
# The lesson: the training step, and how the data and the model come in
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir):
        self.model = model
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(features), labels)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def train_epoch(self, epoch):
        self.model.train()
        totals = torch.zeros(2, device=self.device)  # [sum of per-sample losses, samples]
        for features, labels in self.train_loader:
            features, labels = features.to(self.device), labels.to(self.device)
            # The loss is a mean over the batch; weight it by the batch size so the epoch's
            # mean is over samples, even when the last batch is smaller.
            totals[0] += self.train_step(features, labels) * len(labels)
            totals[1] += len(labels)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """Count correct predictions over the whole test set."""
        self.model.eval()
        features = self.test_set.features.to(self.device)
        labels = self.test_set.labels.to(self.device)
        predictions = self.model(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        return int(counts[0]), int(counts[1])

    def save_checkpoint(self, epoch):
        checkpoint = {"model": self.model.state_dict(), "epochs_completed": epoch + 1}
        save_atomically(checkpoint, os.path.join(self.out_dir, "checkpoint.pt"))

    def train(self, max_epochs):
        losses = []
        for epoch in range(max_epochs):
            start = time.perf_counter()
            loss = self.train_epoch(epoch)
            losses.append(loss)
            print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                  f"| {time.perf_counter() - start:.3f} s", flush=True)
            if (epoch + 1) % self.save_every == 0:
                self.save_checkpoint(epoch)
        return losses


def prepare_dataloader(dataset, batch_size, seed):
    # A seeded generator makes the shuffling, and so the whole run, repeatable.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)


def build_model(args, device):
    """The wine MLP, on this process's device."""
    # Seed before building the model so the initial weights are the same on every run.
    torch.manual_seed(args.seed)
    model = WineMLP().to(device)
    return model


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(args):
    start = time.time()
    device = pick_device(args.device)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed)

    model = build_model(args, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir)
    print(f"training on {device}: {len(train_set)} train / {len(test_set)} test wines, "
          f"batch {args.batch_size}", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    correct, total = trainer.evaluate()
    save_atomically(cpu_state_dict(model), os.path.join(args.out_dir, "final.pt"))
    results = {"train_loss": losses, "test_correct": correct, "test_total": total,
               "test_accuracy": correct / total, "train_seconds": train_seconds,
               "wall_seconds": time.time() - start}
    save_atomically(describe_run(args, device) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


# =============================================================================================
# Plumbing: how the lesson starts, saves and reads its flags. Every lesson ends with it, and only
# the lesson that teaches a piece of it changes that piece: read it once, skip it after.
# =============================================================================================
def pick_device(requested):
    """--device auto: the GPU if there is one, else the CPU; one that is not there: one line."""
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    return guard_rails.check_device(auto if requested == "auto" else requested)


def cpu_state_dict(model):
    # As CPU tensors the weights load on any machine as they are, with a GPU or without.
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


def save_atomically(obj, path):
    # Write to a temporary file in the same folder, then rename it over the target: a crash in
    # the middle of the write leaves the previous file intact instead of a half-written one.
    from guard_rails import save_or_fail  # a failed write (a full disk): one line, not a traceback

    tmp_path = f"{path}.tmp"
    with save_or_fail(path, tmp_path):
        with open(tmp_path, "wb") as f:
            if path.endswith(".json"):  # metrics.json: text, for people and plotting tools
                f.write(json.dumps(obj, indent=2).encode())
            else:
                torch.save(obj, f)
        os.replace(tmp_path, path)


LESSON = os.path.basename(os.path.dirname(os.path.abspath(__file__)))  # this folder's name


def describe_run(args, device):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": LESSON,
        "world_size": 1,
        "backend": None,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.partition("\n")[0],  # the docstring's first line
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write checkpoint.pt every N epochs")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for checkpoint.pt, final.pt and metrics.json")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, torchrun_ok=False)
