"""Troubleshooting: early stopping decided on each rank alone hangs the job.

Each rank evaluates its own share of the validation set, so each sees its own validation loss.
If each rank decides from its own loss when to stop, one rank can leave the training loop while
another starts the next epoch and waits in its gradient all-reduce for a rank that never comes,
until the timeout (PyTorch's default: 10 minutes for NCCL, 30 for gloo). The fix is to decide
together: all-reduce the stop flag with MAX (any rank that wants to stop stops everyone), or
decide on the validation loss of the whole set, all-reduced, so every rank computes the same
decision. This runs 2 ranks with patience 1 on scripted validation losses, first each rank
deciding alone (bounded by a 2-second timeout), then both fixes. See TROUBLESHOOTING.md.

    python troubleshooting/early_stopping.py
"""

import datetime
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# How long a rank waits for a missing one here; PyTorch's default is 30 minutes for gloo.
TIMEOUT = datetime.timedelta(seconds=2)
# For forming the group itself: on a busy machine two fresh processes may take several seconds
# more than each other to import torch, and that must not look like a missing rank.
START = datetime.timedelta(seconds=60)
EPOCHS = 5
PATIENCE = 1  # stop after this many epochs without a better validation loss
# Each rank's validation loss on its own half of the validation set, epoch by epoch: scripted,
# so that every run stops at the same epochs. Rank 0's half happens to get worse first.
VALIDATION_LOSS = {0: [0.90, 0.85, 0.88, 0.95, 0.97], 1: [0.80, 0.70, 0.66, 0.66, 0.65]}


def say(line):
    """One line in one write: the two ranks share this terminal, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class EarlyStopping:
    def __init__(self, patience):
        self.patience, self.best, self.epochs_without_better = patience, math.inf, 0

    def should_stop(self, loss):
        if loss < self.best:
            self.best, self.epochs_without_better = loss, 0
        else:
            self.epochs_without_better += 1
        return self.epochs_without_better >= self.patience


def alone(stopper, loss):
    """The bug: each rank decides from its own validation loss."""
    return stopper.should_stop(loss)


def any_rank(stopper, loss):
    """Fix 1: all ranks stop as soon as any rank wants to (MAX of 0s and 1s)."""
    stop = torch.tensor(float(stopper.should_stop(loss)))
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    return bool(stop)


def whole_set(stopper, loss):
    """Fix 2: decide on the mean over the ranks' halves, the same number on every rank."""
    mean = torch.tensor(loss)
    dist.all_reduce(mean)
    return stopper.should_stop(mean.item() / dist.get_world_size())


def train(model, rank, decide):
    """Train until decide says stop; return the number of epochs trained."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stopper = EarlyStopping(PATIENCE)
    torch.manual_seed(rank)  # each rank its own data
    for epoch in range(EPOCHS):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()  # DDP all-reduces the gradients here
        optimizer.step()
        if decide(stopper, VALIDATION_LOSS[rank][epoch]):
            break
    return epoch + 1


def make_model(group):
    torch.manual_seed(0)
    return DDP(nn.Linear(4, 1), process_group=group)


def worker(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=START)
    # A group of the same two ranks that gives up after TIMEOUT, for the symptom. A group whose
    # collective timed out is not used again; the default group, which waits longer, keeps the
    # ranks in step afterwards and shows the fixes.
    short = dist.new_group(timeout=TIMEOUT)
    # The models for the fixes first, on the default group: the first DDP in a process takes a
    # second or more to set up, and the ranks must not drift apart by TIMEOUT before the symptom.
    fixed_models = {fix: make_model(None) for fix in (any_rank, whole_set)}
    model = make_model(short)
    dist.barrier()  # start the symptom together
    start = time.monotonic()
    try:
        epochs = train(model, rank, alone)
        say(f"rank {rank} stopped early after epoch {epochs}: its own loss got worse")
        dist.barrier(group=short)  # the stopped rank waits here, before saving
    except RuntimeError as error:
        say(f"rank {rank} gave up after {time.monotonic() - start:.0f} s: "
            f"{str(error).splitlines()[0]}")
    dist.barrier()
    if rank == 0:
        say("symptom: rank 0 stops after epoch 3 and waits in barrier; rank 1, whose own loss "
            "still improves, waits in epoch 4's gradient all-reduce, until the timeout")

    for decide, how in ((any_rank, "the stop flag all-reduced with MAX"),
                        (whole_set, "the mean validation loss of both halves")):
        epochs = torch.tensor(train(fixed_models[decide], rank, decide))
        everyone = [torch.zeros_like(epochs) for _ in range(2)]
        dist.all_gather(everyone, epochs)
        if rank == 0:
            trained = " and ".join(str(int(e)) for e in everyone)
            say(f"fix: deciding on {how}: the ranks trained {trained} epochs")
    os._exit(0)  # skip gloo's teardown of the timed-out group at exit


def main():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(worker, nprocs=2)


if __name__ == "__main__":
    main()
