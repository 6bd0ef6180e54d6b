"""Troubleshooting: BatchNorm statistics differ between ranks (and SyncBatchNorm).

DDP averages gradients, nothing else. A BatchNorm layer normalises each batch with that batch's
own mean and variance, and under DDP each rank sees only its own part of the global batch: the
ranks normalise with different statistics, and their running averages (used at evaluation) drift
apart. DDP then hides part of it: by default (forward_sync_buffers=True; broadcast_buffers in
older releases) it copies rank 0's buffers to every rank at each forward pass, so the running
statistics learnt from the other ranks' data are thrown away. nn.SyncBatchNorm computes the
statistics over the whole global batch instead; it runs only on GPUs (CUDA, and a few other
accelerators), so on a CPU this shows the symptom and says why the fix cannot run here. See
TROUBLESHOOTING.md.

    python troubleshooting/batchnorm_stats.py
"""

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

START = datetime.timedelta(seconds=60)  # forming the group: imports may take seconds apart
STEPS = 20


def say(line):
    """One line in one write: the two ranks share this terminal, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def batches(rank):
    """Rank r's 20 batches of 16 values around r * 4: the two ranks' data differ, as when a
    sampler does not shuffle and the data are sorted (by class, by length, by date)."""
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(16, 1, generator=generator) + 4.0 * rank for _ in range(STEPS)]


def running_means(model, device, **ddp_options):
    """Train on this rank's batches; return every rank's running mean afterwards."""
    torch.manual_seed(0)
    model = DDP(model.to(device), device_ids=[device] if device.type == "cuda" else None,
                **ddp_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch in batches(dist.get_rank()):
        optimizer.zero_grad()
        model(batch.to(device)).pow(2).mean().backward()
        optimizer.step()
    mine = model.module[0].running_mean.detach().reshape(1)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [value.item() for value in everyone]


def rounded(values):
    return "[" + ", ".join(f"{value:.2f}" for value in values) + "]"


def make_model():
    return nn.Sequential(nn.BatchNorm1d(1, momentum=None), nn.Linear(1, 1))  # momentum=None:
    # the running mean is the plain average of every batch mean seen, easy to check by hand


def worker(rank, world_size, backend):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=START)
    everything = torch.cat([torch.cat(batches(r)) for r in range(world_size)])
    truth = everything.mean().item()
    separate = running_means(make_model(), device, forward_sync_buffers=False)
    default = running_means(make_model(), device)
    if rank == 0:
        say(f"the mean of all ranks' data: {truth:.2f}")
        say(f"running mean per rank, forward_sync_buffers=False: {rounded(separate)}")
        say(f"running mean per rank, DDP's default (rank 0's buffers broadcast): "
            f"{rounded(default)}")
        say("symptom: each rank normalises with its own batch's statistics; the running means "
            "differ between ranks, or all are rank 0's, and none is the mean of all the data")
    try:
        synced = running_means(nn.SyncBatchNorm.convert_sync_batchnorm(make_model()), device)
    except ValueError as error:
        if rank == 0:
            say(f"SyncBatchNorm on {device.type}: ValueError: {error}")
            say("fix: nn.SyncBatchNorm.convert_sync_batchnorm(model) before DDP; it runs only "
                "on GPUs, so it cannot run on this machine (python "
                "troubleshooting/batchnorm_stats.py on 2 GPUs shows it)")
    else:
        if rank == 0:
            say(f"running mean per rank, SyncBatchNorm: {rounded(synced)}")
            agree = all(abs(value - truth) < 1e-4 for value in synced)
            say(f"fix: SyncBatchNorm gives every rank the statistics of the global batch: {agree}")
    dist.destroy_process_group()
    # Leave at once, as the lessons do (leave_process in guard_rails.py): gloo's threads can abort
    # Python's teardown of a finished rank (notes/teardown_abort.md, pytorch/pytorch#190489).
    sys.stdout.flush()
    os._exit(0)


def main():
    # SyncBatchNorm needs NCCL and one GPU per rank; anywhere else, two CPU ranks over gloo.
    backend = "nccl" if torch.cuda.device_count() >= 2 and dist.is_nccl_available() else "gloo"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    say(f"2 ranks over {backend}")
    mp.spawn(worker, args=(2, backend), nprocs=2)


if __name__ == "__main__":
    main()
