"""What each rank holds, measured: the bytes of its parameters, gradients and optimizer state
(of a sharded tensor, a DTensor, its local shard alone) and its peak memory, gathered into one
table that rank 0 prints and metrics.json records."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local_bytes(tensors):
    """Bytes of the tensors as this rank holds them: of a sharded one (a DTensor), its shard."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_baseline(device):
    """Reset the GPU's peak and return what it holds, for peak_memory_bytes to subtract."""
    if device.type != "cuda":
        return 0
    # cuBLAS keeps megabytes of workspace for each thread that multiplies (backward has its own):
    # made now, they stay out of the peak (torch/testing/_internal/common_utils.py skips them too).
    torch.nn.Linear(2, 2, device=device)(torch.zeros(2, 2, device=device)).sum().backward()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory_bytes(device, baseline):
    """This rank's peak: on a GPU, allocated since memory_baseline; on the CPU, resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - baseline
    if sys.platform == "win32":
        return -1  # Windows has no getrusage: the table says n/a
    import resource  # Unix and macOS only: imported here, so the lesson starts on Windows

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def memory_per_rank(model, optimizer, device, baseline):
    """[parameters, gradients, optimizer state, peak] in bytes, one row per rank; optimizer:
    the one that holds this rank's state. Every rank calls it (an all-gather)."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    row = torch.tensor([local_bytes(params), local_bytes(p.grad for p in params),
                        local_bytes(state), peak_memory_bytes(device, baseline)], device=device)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)  # every rank's row, so that rank 0 can print them all
    return [r.tolist() for r in rows]


def print_memory(memory, layout):
    """Rank 0's table of the bytes each rank held after the last step (none: no step taken)."""
    if not memory:
        return
    print(f"memory per rank ({layout}), bytes held after the last step:", flush=True)
    print(f"{'rank':>4} {'parameters':>12} {'gradients':>12} {'optimizer':>12} "
          f"{'peak':>12}", flush=True)
    for r, row in enumerate(memory):
        print(f"{r:>4} " + " ".join(f"{n:>12,}" if n >= 0 else f"{'n/a':>12}" for n in row),
              flush=True)


def memory_rows(memory):
    """metrics.json's memory: one dict per rank."""
    return [dict(zip(("parameters", "gradients", "optimizer_state", "peak"), row, strict=True))
            for row in memory]
