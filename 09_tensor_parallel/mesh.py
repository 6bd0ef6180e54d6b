"""The ranks as a grid of named dimensions, every group of it waiting --timeout (lessons 09, 11
and 12, byte for byte; lesson 13 lays out its own (pp, dp, tp) grid in parallelize.py)."""

import datetime
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def build_mesh(device, timeout, **sizes):
    """The ranks as a grid, one named dimension per size: build_mesh(device, timeout, dp=2, tp=2)
    is torch.arange(4).view(2, 2), row d TP group d, column t a dp group ([0, 2] and [1, 3]). A
    rank beyond the grid (the benchmark runs smaller meshes in a larger launch) gets None."""
    ranks = torch.arange(math.prod(sizes.values())).view(*sizes.values())
    groups = []
    # Every rank makes every group, in the same order, and keeps its own. Not init_device_mesh,
    # which passes no timeout: its groups wait torch's default (gloo 30 minutes, NCCL 10).
    for dim in range(ranks.dim()):
        for line in ranks.movedim(dim, -1).reshape(-1, ranks.size(dim)):  # the groups along dim
            group = dist.new_group(line.tolist(), timeout=datetime.timedelta(seconds=timeout))
            if dist.get_rank() in line:
                groups.append(group)
    if not groups:
        return None
    return DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=tuple(sizes))
