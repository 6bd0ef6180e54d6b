"""Exercise 09's second part, measured: your transformer block's plan beside the whole block.

    python exercises/block_probe.py my_09/transformer_block.py OUT.pt

exercises/check.py runs it. It starts 2 ranks (gloo, on the CPU), and each builds the whole block
and the split one with your file's build_blocks (and so your tp_plan), with sequence
parallelism (Shard(1) between blocks), runs one forward and one backward on the lesson's input,
and rank 0 writes into OUT.pt, for the output and every parameter, the whole block's value and
each rank's: what the checker compares. It changes nothing in your file.
"""

import argparse
import datetime
import importlib.util
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

RANKS = 2
# The lesson's defaults (transformer_block.py's flags): 4 heads of 8, 8 tokens, 2 sequences.
ARGS = argparse.Namespace(tp=RANKS, heads=4, dim=32, seq=8, batch=2, lr=1e-3, control="none")


def load(path):
    """Your transformer_block.py as a module (its folder first on the path, for its imports)."""
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("your_transformer_block", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local(tensor):
    tensor = tensor.detach()
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).clone()


def as_used(grad):
    """A gradient as the optimizer uses it: a DTensor's pending sums (Partial) added up."""
    return grad.full_tensor().detach() if isinstance(grad, DTensor) else grad.detach().clone()


def measure(rank, path, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=30))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    reference, block = load(path).build_blocks(ARGS, mesh, Shard(1))
    torch.manual_seed(1)
    x = torch.randn(ARGS.batch, ARGS.seq, ARGS.dim)  # the lesson's input, the same on each rank
    tokens = ARGS.batch * ARGS.seq
    reference_out = reference(x)
    (reference_out.pow(2).sum() / tokens).backward()
    out_here = block(x.chunk(RANKS, dim=1)[rank])  # each rank its slice of the sequence
    (out_here.pow(2).sum() / tokens).backward()
    mine = {"out": local(out_here), "params": {
        name: {"split": isinstance(p, DTensor),
               "grad": None if p.grad is None else local(p.grad),
               "used": None if p.grad is None else as_used(p.grad)}
        for name, p in block.named_parameters()}}
    every = [None] * RANKS
    dist.all_gather_object(every, mine)
    if rank == 0:
        torch.save({"ranks": every, "out": reference_out.detach(),
                    "grads": {name: p.grad for name, p in reference.named_parameters()}}, out)
    dist.destroy_process_group()


def main():
    path, out = sys.argv[1:3]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(measure, args=(os.path.abspath(path), out, port), nprocs=RANKS,
                       start_method="spawn")


if __name__ == "__main__":
    main()
