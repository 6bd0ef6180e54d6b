"""torch 2.14's context_parallel on a CPU mesh: the first attention stops (lesson 11's README).

    python tools/repro_context_parallel_cpu.py

Two gloo ranks, a 1-D mesh, and scaled_dot_product_attention inside context_parallel: on the CPU,
torch picks its CPU flash kernel, for which DTensor has no sharding rule, and raises
NotImplementedError ("... _scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered"). On CUDA the same code runs (its flash and memory-efficient
kernels have rules). Prints the error's first line from rank 0, and exits 0 if it was raised.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel


def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        raised = False
    except NotImplementedError as error:
        raised = True
        if rank == 0:
            print(f"NotImplementedError: {str(error).strip().splitlines()[0]}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if raised else 1)


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    try:
        mp.start_processes(run, args=(free,), nprocs=2, start_method="spawn")
    except mp.ProcessExitedException:
        sys.exit("context_parallel ran on the CPU: this torch no longer stops there")
