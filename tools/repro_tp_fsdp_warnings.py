"""Show the two warnings that guard_rails.py silences for lesson 09's 2-D runs (FSDP x TP).

    python tools/repro_tp_fsdp_warnings.py

With torch 2.14, a model split by tensor parallelism (parallelize_module) and then sharded by
FSDP2 (fully_shard) over the other dimension of a 2 x 2 mesh, as lesson 09 does, makes two
warnings on every rank, neither about anything the lesson does wrong:

- FSDP's "FSDP2-wrapped module (FSDPLinear) returned a view tensor" (torch/distributed/fsdp/
  _fully_shard/_fsdp_state.py), in the first forward: TP hands the layer's output on as a plain
  tensor, a view of its DTensor, and FSDP warns that an in-place op on a view would skip its
  backward hook. The lesson's model makes no in-place op.
- DTensor's "2 sequential all_gather operations will be performed" (torch/distributed/tensor/
  _redistribute.py), when get_model_state_dict gathers the weights whole for final.pt: a note
  on the speed of a gather made once a run.

This script starts 4 gloo processes on the CPU, builds lesson 09's 13 -> 64 -> 3 MLP, splits it
the lesson's way, takes one step and gathers the state dict, and counts both warnings. It exits
0 when both appear (the behaviour guard_rails.py silences), 1 otherwise: then the filters can go.
"""

import logging
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Counter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def rank_main(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    counter = Counter()
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(counter)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(8, 13)).sum().backward()
    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    views = sum("returned a view tensor" in str(w.message) for w in caught)
    gathers = sum("sequential all_gather" in message for message in counter.messages)
    results.put((rank, views, gathers))
    dist.destroy_process_group()


def main():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(port, results), nprocs=4)
    counts = sorted(results.get() for _ in range(4))
    for rank, views, gathers in counts:
        print(f"rank {rank}: 'returned a view tensor' {views} time(s), "
              f"'sequential all_gather' {gathers} time(s)")
    both = all(views and gathers for _, views, gathers in counts)
    print("both warnings on every rank:", both)
    sys.exit(0 if both else 1)


if __name__ == "__main__":
    main()
