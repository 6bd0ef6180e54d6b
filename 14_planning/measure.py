"""Lesson 14's instruments, for fake tensors: what a rank holds (local_bytes, gathered), saves for
backward (SavedBytes), leaves held (NewStorages), and sends (CountCollectives)."""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


def local_bytes(tensors):
    """Bytes of the tensors as this rank holds them: of a sharded one (a DTensor), its shard."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def gathered(model):
    """Bytes of the weights held gathered now: not sharded over dp (FSDP's units unsharded)."""
    return local_bytes(p for p in model.parameters()
                       if not (isinstance(p, DTensor) and "dp" in p.device_mesh.mesh_dim_names))


def memory(tensor):
    """The block of memory a tensor views, and a name for it (a fake one's data pointer is 0)."""
    block = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
    return StorageWeakRef(block), block.nbytes()


class SavedBytes:
    """Bytes saved for backward, by micro-batch: each memory block once, not the weights."""

    def __init__(self):
        self.seen, self.bytes = set(), []

    def pack(self, tensor):
        base = tensor._base if tensor._base is not None else tensor
        name, size = memory(tensor)
        if not isinstance(base, torch.nn.Parameter) and name not in self.seen:
            self.seen.add(name)
            self.bytes[-1] += size
        return tensor

    def micro_batch(self):
        self.bytes.append(0)
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


class NewStorages(TorchDispatchMode):
    """The memory made while it is active; live() says how much of it is still held."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # its local ops come here
        out = func(*args, **(kwargs or {}))
        self.made.update(memory(t) for t in (out if isinstance(out, (tuple, list)) else [out])
                         if isinstance(t, torch.Tensor))
        return out

    def live(self, besides=()):
        others = {memory(t)[0] for t in besides if t is not None}
        return sum(n for ref, n in self.made.items() if not ref.expired() and ref not in others)


# As the dispatcher sees them: (kind, the tensor's place in the arguments, the group's place)
COLLECTIVES = {
    "_c10d_functional::all_gather_into_tensor": ("all-gather", 0, 2),  # DTensor, CP
    "_c10d_functional::reduce_scatter_tensor": ("reduce-scatter", 0, 3),
    "_c10d_functional::all_reduce": ("all-reduce", 0, 2),
    "c10d::_allgather_base_": ("all-gather", 1, 2),  # FSDP2
    "c10d::_reduce_scatter_base_": ("reduce-scatter", 1, 2),
    "c10d::allreduce_": ("all-reduce", 0, 1),  # DDP, the clip
    "c10d::send": ("send", 0, 1),  # the pipeline
}
RING = {"all-gather": lambda b, n: (n - 1) * b, "reduce-scatter": lambda b, n: (n - 1) * b // n,
        "all-reduce": lambda b, n: 2 * (n - 1) * b // n, "send": lambda b, n: b}


class CountCollectives(TorchDispatchMode):
    """Calls and bytes sent (as a ring sends them) by (phase of the step, dimension, kind)."""

    def __init__(self, groups):
        super().__init__()
        self.groups, self.phase, self.calls, self.bytes = groups, None, Counter(), Counter()
        self.dimension_of = {group.group_name: name for name, group in groups.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into local ops and collectives, seen here
        if func.name() in COLLECTIVES and self.phase:
            kind, at, group_at = COLLECTIVES[func.name()]
            tensor, group = args[at], args[group_at]  # c10d's take lists of tensors
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            group = (dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str)
                     else dist.ProcessGroup.unbox(group))  # funcol names it; c10d boxes it
            if group.size() > 1:  # a group of one rank moves nothing
                key = (self.phase, self.dimension_of[group.group_name], kind)
                self.calls[key] += 1
                self.bytes[key] += RING[kind](tensor.numel() * tensor.element_size(), group.size())
        return func(*args, **(kwargs or {}))
