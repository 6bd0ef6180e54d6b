"""Show that FSDP2's fully_shard refuses a model whose weights are in channels_last format.

    python tools/repro_fsdp_channels_last.py

benchmarks/scaling.py runs ResNet-18 in channels_last on GPUs (the layout cuDNN's fastest
convolutions use), but its fsdp rows keep the default layout: with torch 2.14, fully_shard
raises NotImplementedError ("FSDP does not support non-contiguous parameters yet") for a 4-D
convolution weight in channels_last, whose strides are not the contiguous ones. A proposal to
support it, pytorch/pytorch#137382, was closed. This script builds one convolution in each
layout, shards it in a one-process gloo group on the CPU (no GPU needed: the check is on the
strides), and prints what happened. It exits 0 when fully_shard refuses channels_last and
accepts the default layout, the behaviour the benchmark works around; 1 otherwise, which means
the workaround can go.
"""

import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard(memory_format):
    conv = torch.nn.Conv2d(64, 64, 3).to(memory_format=memory_format)
    try:
        fully_shard(conv, mesh=init_device_mesh("cpu", (1,)))
    except NotImplementedError as error:
        return f"refused: {str(error).splitlines()[0]}"
    return "sharded"


def main():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        layouts = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
        results = {name: shard(layout) for name, layout in layouts.items()}
    finally:
        dist.destroy_process_group()
    for name, result in results.items():
        print(f"torch {torch.__version__}, fully_shard on a {name} Conv2d weight: {result}")
    reproduced = (results["contiguous"] == "sharded"
                  and results["channels_last"].startswith("refused"))
    print("reproduced: FSDP2 shards only contiguous parameters" if reproduced else
          "not reproduced: this torch shards channels_last parameters; the benchmark's fsdp rows "
          "could use channels_last")
    raise SystemExit(0 if reproduced else 1)


if __name__ == "__main__":
    main()
