"""Troubleshooting: uneven inputs hang the job at the end of an epoch (and Join).

DDP all-reduces the gradients in every backward pass, so every rank must run the same number of
steps. If one rank has more batches than another (its own shard of a stream, an IterableDataset,
a hand-made split), the rank with more waits in its extra backward pass for a gradient
all-reduce that the other, already done, never joins. DistributedSampler avoids this by padding;
where you cannot use it, torch.distributed.algorithms.Join lets the finished ranks shadow the
collectives of the others. This runs 3 steps on rank 0 and 2 on rank 1, first plainly (bounded
by a 2-second timeout), then under Join. See TROUBLESHOOTING.md.

    python troubleshooting/uneven_inputs.py
"""

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

# How long a rank waits for a missing one here; PyTorch's default is 30 minutes for gloo.
TIMEOUT = datetime.timedelta(seconds=2)
# For forming the group itself: on a busy machine two fresh processes may take several seconds
# more than each other to import torch, and that must not look like a missing rank.
START = datetime.timedelta(seconds=60)
STEPS = {0: 3, 1: 2}  # batches per rank: rank 0 has one more


def say(line):
    """One line in one write: the two ranks share this terminal, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(model, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)  # each rank its own data
    for _ in range(STEPS[rank]):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()  # DDP all-reduces the gradients here
        optimizer.step()


def make_model(group):
    torch.manual_seed(0)
    return DDP(nn.Linear(4, 1), process_group=group)


def worker(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=START)
    # A group of the same two ranks that gives up after TIMEOUT, for the symptom. A group whose
    # collective timed out is not used again; the default group, which waits longer, keeps the
    # ranks in step afterwards and shows the fix.
    short = dist.new_group(timeout=TIMEOUT)
    # The model for the fix first, on the default group: the first DDP in a process takes a
    # second or more to set up, and the ranks must not drift apart by TIMEOUT before the symptom.
    joined_model = make_model(None)
    model = make_model(short)
    dist.barrier()  # start the symptom together
    start = time.monotonic()
    try:
        train(model, rank)
        dist.barrier(group=short)  # the finished rank waits here, before saving or evaluating
    except RuntimeError as error:
        say(f"rank {rank} gave up after {time.monotonic() - start:.0f} s: "
            f"{str(error).splitlines()[0]}")
    dist.barrier()
    if rank == 0:
        say(f"symptom: rank 0 waits in its step {STEPS[0]} gradient all-reduce, rank 1 (done "
            f"after {STEPS[1]} steps) in barrier, each for the other, until the timeout")

    model = joined_model
    with Join([model]):  # a rank that runs out of data joins the others' all-reduces with zeros
        train(model, rank)
    dist.barrier()
    weights = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(weights, model.module.weight.detach().flatten())
    if rank == 0 and torch.equal(weights[0], weights[1]):
        say(f"fix: under Join both ranks finish ({STEPS[0]} and {STEPS[1]} steps) with the same "
            "weights")
    os._exit(0)  # skip gloo's teardown of the timed-out group at exit


def main():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(worker, nprocs=2)


if __name__ == "__main__":
    main()
