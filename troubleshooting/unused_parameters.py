"""Troubleshooting: a parameter that gets no gradient stops DDP at the second step.

DDP all-reduces the gradients bucket by bucket, as backward produces them, and a bucket goes out
only when every parameter in it has its gradient. A parameter that the forward pass did not use
(an unused head, a branch not taken) never gets one, so the first step's reduction never
finishes, and the next forward pass stops with "Expected to have finished reduction in the prior
iteration before starting a new one". The fixes: find_unused_parameters=True (DDP then walks the
autograd graph after every forward to mark what was not used; it costs a little each step) or
static_graph=True (DDP learns in the first step which parameters go unused, and that set must be
the same in every step). This runs 2 CPU ranks over gloo: plain DDP, then each fix. See
TROUBLESHOOTING.md.

    python troubleshooting/unused_parameters.py
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

# For forming the group: two fresh processes may take several seconds apart to import torch.
START = datetime.timedelta(seconds=60)


def say(line):
    """One line in one write: the two ranks share this terminal, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class TwoHeads(nn.Module):
    """A body and two heads, of which forward uses only the first: aux never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)  # e.g. a head for a second task, switched off here

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def train(model, rank, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)  # each rank its own data
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()


def make_model(**ddp_options):
    torch.manual_seed(0)
    return DDP(TwoHeads(), **ddp_options)


def weights_agree(model):
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def worker(rank):
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=START)
    model = make_model()
    try:
        train(model, rank)
    except RuntimeError as error:
        if rank == 0:
            text = str(error)
            say(f"rank 0: RuntimeError: {text.split('. ')[0]}. ...")
            indices = next(line for line in text.splitlines() if "did not receive grad" in line)
            say(f"  {indices.strip()}")
            # The indices count model.parameters(); their names say which layer went unused.
            names = [name for name, _ in model.module.named_parameters()]
            unused = [names[int(i)] for i in indices.split(":")[1].split()]
            say(f"symptom: the second step stops at once; parameters {', '.join(unused)} got no "
                "gradient in the first")
    dist.barrier()  # the failed step's all-reduce never started, so the ranks are still in step

    for fix in ({"find_unused_parameters": True}, {"static_graph": True}):
        model = make_model(**fix)
        train(model, rank)
        agree = weights_agree(model)
        if rank == 0:
            option = ", ".join(f"{key}={value}" for key, value in fix.items())
            say(f"fix: DDP(model, {option}): 3 steps, the same weights on both ranks: {agree}")
    dist.destroy_process_group()
    # Leave at once, as the lessons do (leave_process in guard_rails.py): gloo's threads can abort
    # Python's teardown of a finished rank (notes/teardown_abort.md, pytorch/pytorch#190489).
    sys.stdout.flush()
    os._exit(0)


def main():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(worker, nprocs=2)


if __name__ == "__main__":
    main()
