"""Troubleshooting: a collective times out while rank 0 evaluates or saves alone.

Rank 0 alone evaluates (or saves a large checkpoint) between two steps, while the other ranks
go on to the next collective, the next step's gradient all-reduce, and wait there for rank 0. If
rank 0's work takes longer than the process group's timeout (PyTorch's default: 10 minutes for
NCCL, 30 for gloo), the waiting ranks give up: NCCL's "Watchdog caught collective operation
timeout", gloo's "Timed out waiting ...ms for recv operation". Here the timeout is 2 seconds
and rank 0's evaluation takes 3. This shows the symptom, then that a barrier after the
evaluation moves the timeout into the barrier, then two fixes: the evaluation split between
the ranks, and a longer timeout. See TROUBLESHOOTING.md.

    python troubleshooting/slow_rank_zero.py
"""

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# How long a rank waits for another here; PyTorch's default is 30 minutes for gloo.
TIMEOUT = datetime.timedelta(seconds=2)
# For forming the group itself: on a busy machine two fresh processes may take several seconds
# more than each other to import torch, and that must not look like a missing rank.
START = datetime.timedelta(seconds=60)
EVALUATION = 3.0  # seconds of work for one rank evaluating the whole validation set


def say(line):
    """One line in one write: the two ranks share this terminal, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def evaluate(seconds):
    """A stand-in for evaluating or saving: only the time it takes matters here."""
    time.sleep(seconds)


def attempt(rank, what, work, timeout=TIMEOUT):
    """Run work(group) on both ranks in a fresh group that gives up after timeout; what[rank]
    says what the rank does. Return each rank's seconds of waiting for the other, or None for a
    rank that gave up. A group whose collective timed out is not used again; the default group,
    which waits longer, keeps the ranks in step between attempts."""
    group = dist.new_group(timeout=timeout)
    dist.barrier()  # start together
    start = time.monotonic()
    try:
        waited = work(group)
    except RuntimeError as error:
        say(f"rank {rank} gave up after {time.monotonic() - start:.0f} s ({what[rank]}): "
            f"{str(error).splitlines()[0]}")
        waited = -1.0
    waits = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(waits, torch.tensor([waited]))
    return [None if w < 0 else w.item() for w in waits]


def waiting(collective):
    """How long collective took: with a tensor this small, the time spent waiting for the other
    rank."""
    start = time.monotonic()
    collective()
    return time.monotonic() - start


def worker(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=START)
    grads = torch.ones(4)  # stands for the next step's gradients

    # The symptom: rank 0 evaluates alone; rank 1 is already in the next step's all-reduce.
    def rank_zero_evaluates(group):
        if rank == 0:
            evaluate(EVALUATION)
        return waiting(lambda: dist.all_reduce(grads, group=group))

    waits = attempt(rank, {0: "evaluates, then all_reduce", 1: "all_reduce"},
                    rank_zero_evaluates)
    if rank == 0 and waits[1] is None:
        say(f"symptom: rank 0 evaluates for {EVALUATION:.0f} s; rank 1 waits for it in the next "
            f"all_reduce and gives up after the group's {TIMEOUT.seconds} s timeout")

    # A barrier after rank 0's evaluation: rank 1 now waits in the barrier, for just as long.
    def with_a_barrier(group):
        if rank == 0:
            evaluate(EVALUATION)
        return waiting(lambda: dist.barrier(group=group))

    waits = attempt(rank, {0: "evaluates, then barrier", 1: "barrier"}, with_a_barrier)
    if rank == 0 and waits[1] is None:
        say("symptom: with a barrier after the evaluation, rank 1 times out in the barrier "
            "instead")

    # Fix 1: every rank evaluates its share of the validation set, and one all_reduce adds up
    # the results (lesson 02's evaluate): no rank waits for another, and it is done sooner.
    def every_rank_evaluates(group):
        evaluate(EVALUATION / 2)  # this rank's half
        return waiting(lambda: dist.all_reduce(grads, group=group))

    waits = attempt(rank, {0: "evaluates half", 1: "evaluates half"}, every_rank_evaluates)
    if rank == 0 and None not in waits:
        say(f"fix 1: each rank evaluates half ({EVALUATION / 2:.1f} s), then all_reduce: they "
            f"waited {waits[0]:.1f} and {waits[1]:.1f} s, within the same {TIMEOUT.seconds} s "
            "timeout")

    # Fix 2: a timeout longer than rank 0's work. It keeps the other ranks idle meanwhile.
    longer = datetime.timedelta(seconds=5)
    waits = attempt(rank, {0: "evaluates, then all_reduce", 1: "all_reduce"},
                    rank_zero_evaluates, timeout=longer)
    if rank == 0 and None not in waits:
        say(f"fix 2: with timeout={longer.seconds} s, rank 1 waits {waits[1]:.1f} s in "
            "all_reduce for rank 0's evaluation, and goes on")
    os._exit(0)  # skip gloo's teardown of the timed-out groups at exit


def main():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(worker, nprocs=2)


if __name__ == "__main__":
    main()
