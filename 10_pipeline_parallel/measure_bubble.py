"""Lesson 10's bubble, measured: train.py's pipeline with every layer's compute simulated.

Each layer of a stage sleeps --simulate-ms in its forward (F), --backward-ms in the gradient of
its input (B), --weight-ms in the gradient of its weights (W) (timeline.py), so the ranks' real
timestamps show when each stage worked and when it waited. After training, rank 0 prints the
bubble of every step but the first, beside the paper's prediction, each rank's order and the
activations it held at most, and writes them to --out-dir/bubble.json. train.py does not import
this file: every other flag is train.py's.

Run it:
    python 10_pipeline_parallel/measure_bubble.py --schedule 1f1b --out-dir runs/10_bubble_1f1b
    python 10_pipeline_parallel/measure_bubble.py --schedule zbv --out-dir runs/10_bubble_zbv
"""

import argparse
import os
import sys

import torch.distributed as dist

import guard_rails
import train
from timeline import print_schedule_report, schedule_report, simulate_compute

# Defaults for a bubble worth measuring: 4 stages of 2 layers, 8 micro-batches, one epoch.
DEFAULTS = ["--stages", "4", "--layers", "7", "--microbatches", "8", "--epochs", "1",
            "--out-dir", "runs/10_bubble"]


class MeasuredTrainer(train.Trainer):
    """train.py's Trainer, each stage's compute simulated and every step's events kept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.args
        self.events, self.timeline = [], []  # this step's events, and every step's
        for stage in self.stages:
            simulate_compute(stage, stage.index, self.events, a.simulate_ms, a.backward_ms,
                             a.weight_ms)

    def train_step(self, features, labels):
        loss = super().train_step(features, labels)
        self.timeline.append(list(self.events))
        self.events.clear()
        return loss

    def train(self, max_epochs):
        losses = super().train(max_epochs)
        if self.timeline:  # a collective: every rank sends its timeline to rank 0
            report = schedule_report(self, dist.get_rank(self.pp_group))
            if report:
                print_schedule_report(report, self.args)
                train.save_atomically(report, os.path.join(self.out_dir, "bubble.json"))
        return losses


def main(rank, args):
    plain, train.Trainer = train.Trainer, MeasuredTrainer  # train.main builds its trainer so
    try:
        train.main(rank, args)
    finally:
        train.Trainer = plain


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 10: measure the bubble of a schedule (any other flag: train.py's).")
    parser.add_argument("--simulate-ms", type=float, default=20, help="F: ms a layer, forward")
    parser.add_argument("--backward-ms", type=float, help="B: ms a layer (default: F's)")
    parser.add_argument("--weight-ms", type=float, help="W: ms a layer (default: F's)")
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = train.parse_args([*DEFAULTS, *rest])  # later flags win: the learner's over DEFAULTS
    args.simulate_ms = ours.simulate_ms
    args.backward_ms = ours.simulate_ms if ours.backward_ms is None else ours.backward_ms
    args.weight_ms = ours.simulate_ms if ours.weight_ms is None else ours.weight_ms
    guard_rails.check_simulated_ms(args)
    return args


if __name__ == "__main__":
    guard_rails.start(main, parse_args, train.launch)
