"""Troubleshooting: a job that hangs at start-up, or at its first collective.

A DDP job waits whenever a rank is missing: at start-up, init_process_group waits until all
world_size ranks have arrived; later, every collective (the gradient all-reduce, a barrier)
waits until every rank has called it. PyTorch's default timeouts are 30 minutes (gloo) and
10 (NCCL), so "missing" looks like a hang. This shows both waits, bounded by a 2-second
timeout: a rank that never starts, and a collective that only rank 0 calls (the classic
`if rank == 0: dist.all_reduce(...)`); then how TORCH_DISTRIBUTED_DEBUG=DETAIL names the
mismatch, and the fix. See TROUBLESHOOTING.md.

    python troubleshooting/hang.py
"""

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# How long a rank waits for a missing one here; PyTorch's default is 30 minutes for gloo.
TIMEOUT = datetime.timedelta(seconds=2)
# For forming the group itself: on a busy machine two fresh processes may take several seconds
# more than each other to import torch, and that must not look like a missing rank.
START = datetime.timedelta(seconds=60)


def say(line):
    """One line in one write: the two ranks share this terminal, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def use_free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def first_line(error):
    return str(error).splitlines()[0]


def rank_that_never_comes():
    """Rank 0 of a job of 2 whose rank 1 was never started (a wrong --world-size, a node that
    was not launched, or one that cannot reach MASTER_ADDR)."""
    use_free_port()
    start = time.monotonic()
    try:
        dist.init_process_group("gloo", rank=0, world_size=2, timeout=TIMEOUT)
    except dist.DistError as error:
        say(f"start-up: rank 0 waited {time.monotonic() - start:.0f} s, then "
            f"init_process_group raised {type(error).__name__}:\n  {first_line(error)}")
        say("symptom: rank 0 waits at init_process_group for a rank that never comes")


def worker(rank):
    """Both ranks start, so the group forms; then rank 1 skips a collective."""
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=START)
    if rank == 0:
        say("fix: with every rank started (here by mp.spawn), the group forms")
    # Two groups of the same two ranks that give up after TIMEOUT: one plain, one with the
    # checks of TORCH_DISTRIBUTED_DEBUG=DETAIL (set_debug_level is that variable, set from
    # code). A group whose collective timed out is not used again; the default group, which
    # waits longer, keeps the ranks in step between the parts and shows the fix.
    plain = dist.new_group(timeout=TIMEOUT)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    checked = dist.new_group(timeout=TIMEOUT)
    dist.set_debug_level(dist.DebugLevel.OFF)

    loss = torch.tensor([float(rank + 1)])
    dist.barrier()  # start the symptom together
    start = time.monotonic()
    try:
        if rank == 0:  # the bug: a collective that only rank 0 calls
            dist.all_reduce(loss, group=plain)
        dist.barrier(group=plain)  # every rank then waits for the others here
    except RuntimeError as error:
        say(f"rank {rank} gave up after {time.monotonic() - start:.0f} s: "
            f"{first_line(error)}")
    dist.barrier()
    if rank == 0:
        say("symptom: rank 0 waits in all_reduce, rank 1 in barrier, each for the other, "
            "until the timeout")

    # The same mistake in the group with DETAIL's checks: before each collective the ranks
    # compare what they are about to run, and stop at once when it differs.
    try:
        if rank == 0:
            dist.all_reduce(loss, group=checked)
        dist.barrier(group=checked)
    except RuntimeError as error:
        if rank == 0:
            message = first_line(error).split(", TensorShape")[0]
            say(f"with TORCH_DISTRIBUTED_DEBUG=DETAIL, rank 0 stops at once: {message}, ...")
    dist.barrier()
    if rank == 0:
        say("diagnosis: DETAIL names the collective that rank 0 runs and rank 1 does not")

    # The fix: every rank calls every collective, in the same order; only the printing is
    # gated on the rank.
    dist.all_reduce(loss)
    dist.barrier()
    if rank == 0:
        say(f"fix: all_reduce on every rank, then the barrier: done, sum = {loss.item():g}")
    os._exit(0)  # skip gloo's teardown of the timed-out group at exit


def main():
    rank_that_never_comes()
    use_free_port()
    mp.spawn(worker, nprocs=2)


if __name__ == "__main__":
    main()
