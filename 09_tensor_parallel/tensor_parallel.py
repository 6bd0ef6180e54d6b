"""Lesson 09's idea: tensor parallelism, each layer itself split across the ranks of a TP group,
and FSDP across the groups: 2-D, on mesh.py's dp x tp device mesh.

tensor_parallel_plan says how each linear layer is split (column-wise, then row-wise, pair after
pair: Megatron-LM's layout); split_model applies that plan over "tp" with parallelize_module,
then lesson 07's FSDP over "dp". The rest shows it at work: which wines each rank reads
(show_who_reads_what) and the collectives of one step (StepCollectives, print_collectives),
beside what the plan predicts.
"""

import contextlib

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def tensor_parallel_plan(model):
    """{layer: how it is split}: column-wise, then row-wise, pair after pair (Megatron-LM).

    Column-wise: rank t holds rows t of the weight (nn.Linear's weight is out x in), so it
    computes output columns t, from the whole input. Row-wise: rank t holds the matching input
    columns, multiplies the output columns t the layer before left it, and gets a partial sum
    of the whole output; an all-reduce adds them. The ReLU between them works column by column,
    so nothing moves between the two layers of a pair."""
    names = ["fc1", *(f"hidden.{i}" for i in range(len(model.hidden))), "fc2"]
    return {name: RowwiseParallel() if i % 2 else ColwiseParallel() for i, name in enumerate(names)}


def split_model(model, mesh):
    """Tensor parallel across "tp", then FSDP across "dp": each rank keeps 1/(dp x tp)."""
    if mesh["tp"].size() > 1:
        # Each weight becomes a DTensor: this rank's slice, and on which ranks the others are.
        # Every rank built the same model from the same seed, so each slice is the one it keeps.
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
    if mesh["dp"].size() > 1:
        # Lesson 07's FSDP, on the ranks that hold the same slices: it cuts each TP slice again,
        # along dim 0, and averages the gradients over "dp". Each dp row reads its own batches.
        for layer in (model.fc1, *model.hidden, model.fc2):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


class StepCollectives:
    """The collectives of the run's first step, by kind, forward and backward apart: counts is
    {"forward": {"all-reduce": 1}, "backward": {}}, or None while no step has run."""

    def __init__(self):
        self.counts = None

    @contextlib.contextmanager
    def first_time(self, phase):
        """Count the collectives of what runs inside, the first time only (CommDebugMode sees
        every collective, a DTensor's and FSDP's, as it is issued)."""
        if phase in (self.counts or {}):
            yield
            return
        with CommDebugMode() as comms:
            yield
        self.counts = {**(self.counts or {}), phase: count_collectives(comms)}


def count_collectives(comms):
    """{"all-reduce": n, ...}: the collectives a CommDebugMode saw, by kind."""
    counts = {}
    for op, n in comms.get_comm_counts().items():
        name = str(op).replace("_", "")  # c10d.allreduce_, c10d._allgather_base_, ...
        kind = next((k for k in ("all-reduce", "all-gather", "reduce-scatter")
                     if k.replace("-", "") in name), name)
        counts[kind] = counts.get(kind, 0) + n
    return counts


def show_who_reads_what(rank, mesh, train_loader):
    """Rank 0 prints the mesh and the first wines of each rank's first batch: the same in a row."""
    first = list(train_loader.sampler)[:4]  # the sampler's order, which the loader follows
    firsts = [None] * dist.get_world_size()
    dist.all_gather_object(firsts, first)
    if rank == 0:
        for d, row in enumerate(mesh.mesh.tolist()):
            print(f"TP group {d} (dp rank {d}): ranks {row} split each layer and read the same "
                  "wines " + ", ".join(f"{firsts[r]}" for r in row), flush=True)


def print_collectives(collectives, args):
    """The first step's collectives on rank 0, beside what tensor parallelism predicts (none: no
    step was taken)."""
    if not collectives:
        return

    def listed(counts):
        return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) or "none"

    pairs = (args.layers + 1) // 2 if args.tp > 1 else 0  # --layers + 1 linear layers, paired
    print(f"collectives in one step, rank 0: forward {listed(collectives['forward'])} | "
          f"backward {listed(collectives['backward'])}", flush=True)
    print(f"tensor parallelism predicts: forward all-reduce {pairs} (one per row-wise layer) | "
          f"backward all-reduce {max(pairs - 1, 0)} (one per column-wise layer but fc1)",
          flush=True)
