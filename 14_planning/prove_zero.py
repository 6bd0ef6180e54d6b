"""The ZeRO paper's Figure 1 (Rajbhandari et al., SC'20), measured with PyTorch's counterpart of
each stage: the bytes of model states a rank holds when Psi = 7.5 B parameters train with Adam
(K = 12) on N_d = 64 data-parallel ranks.

    python 14_planning/prove_zero.py

The model: 60 layers of 3,125 inputs and 40,000 outputs (125 M weights each, so FSDP's cut of
their rows is even), side by side on one input and summed: model states do not depend on the
order of the layers. Rank 0 of 64 is built in the fake process group under fake tensors
(fake_ranks.as_rank), one step runs, and measure.py counts: the weights, the weights held
gathered (from forward to backward, or the most at once), the gradients, Adam's state. DDP's
row is the whole model on every rank, its own gradients (as DDP's all-reduce leaves them): DDP's
C++ reducer cannot run a backward in the fake process group; it would hold a second copy of the
gradients in its buckets, 4 Psi, unless gradient_as_bucket_view=True (DDP's documentation). The
paper's baseline keeps fp16 weights and gradients (2 + 2 bytes) and fp32 master weights,
momentum and variance (K = 12); PyTorch's DDP and ZeroRedundancyOptimizer keep float32 weights,
which are the master copy, and float32 gradients; FSDP2 with mixed precision keeps float32
shards and gathers bf16 copies to compute. Each row must differ from the paper by what it names,
to the byte; the control, FSDP without a unit per layer, must not hold ZeRO-3's 1.9 GB.
"""

import contextlib

import torch
import torch.distributed as dist
from fake_ranks import as_rank
from measure import gathered, local_bytes
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # private, torch 2.14
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

N, LAYERS, IN, OUT = 64, 60, 3125, 40000
PSI = LAYERS * IN * OUT  # 7.5 B
GB = 1e9


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(IN, OUT, bias=False) for _ in range(LAYERS))

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def states(way):
    """Rank 0's model states after one step of the stack trained `way`: bytes by kind."""
    with as_rank(0, N):
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = Stack()
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if way.startswith("FSDP2"):  # else the whole model, as DDP holds it on every rank
            for layer in model.layers if way != "FSDP2, the root only" else []:
                fully_shard(layer, mesh=mesh, mp_policy=mixed, reshard_after_forward=way == "FSDP2")
            fully_shard(model, mesh=mesh, mp_policy=mixed)
        most = [0]  # the weights held gathered at once, at each layer's forward
        for layer in model.layers:
            layer.register_forward_hook(lambda *_: most.append(gathered(model)))
        with mode:
            zero = way == "ZeroRedundancyOptimizer"
            optimizer = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam) if zero
                         else torch.optim.Adam(model.parameters()))
            tracker = FSDPMemTracker(model, optimizer) if way == "FSDP2" else None
            with tracker or contextlib.nullcontext():
                y = model(torch.empty(1, IN))
                held = gathered(model) if way.startswith("FSDP2") else 0  # until backward
                y.sum().backward()
                optimizer.step()
            state = optimizer.optim.state if zero else optimizer.state
            found = {"weights": local_bytes(model.parameters()), "gathered": held,
                     "gradients": local_bytes(p.grad for p in model.parameters()),
                     "optimizer": local_bytes(t for s in state.values() for t in s.values()
                                              if t.dim() > 0),
                     "at once": max(most)}
            if tracker:
                found["tracker"] = tracker.get_tracker_snapshot("current")
    return found


# Paper's stage, its GB and formula (bytes), PyTorch's counterpart, and what PyTorch keeps besides.
ROWS = [
    ("baseline DP", 120.0, (2 + 2 + 12) * PSI, "DDP",
     "float32 weights and gradients (4 + 4 bytes), the weights the master copy: 16 bytes too"),
    ("P_os", 31.4, (2 + 2) * PSI + 12 * PSI / N, "ZeroRedundancyOptimizer",
     "float32 weights and gradients, whole; Adam's state by whole parameters, 1 of 60 here"),
    ("P_os+g", 16.6, 2 * PSI + (2 + 12) * PSI / N, "FSDP2, kept",
     "the gradients' shards in float32, not fp16: 2 Psi / N_d more"),
    ("P_os+g+p", 1.9, (2 + 2 + 12) * PSI / N, "FSDP2", "nothing"),
]


def main():
    print(f"Psi = {PSI / 1e9:g} B weights, N_d = {N} ranks, Adam; rank 0's model states (GB = 1e9 "
          "bytes), the paper's Figure 1 beside PyTorch's counterpart:")
    besides = {"DDP": 0, "ZeroRedundancyOptimizer": 4 * PSI - 12 * PSI / N + 8 * OUT * IN,
               "FSDP2, kept": 2 * PSI / N, "FSDP2": 0}
    exact = True
    for stage, printed, formula, way, why in ROWS:
        found = states(way)
        total = sum(found[k] for k in ("weights", "gathered", "gradients", "optimizer"))
        exact &= total == formula + besides[way]
        print(f"  {stage:10} paper {printed:5.1f} ({formula / GB:7.3f}) | {way:23} "
              f"{total / GB:7.3f}: weights {found['weights'] / GB:.3f}, gathered "
              f"{found['gathered'] / GB:.3f}, gradients {found['gradients'] / GB:.3f}, Adam "
              f"{found['optimizer'] / GB:.3f}; besides the paper's: {why}")
        if way == "FSDP2":
            fsdp = found
    print(f"every row the paper's formula and what it names, to the byte: {exact}")
    one = OUT * IN * 2  # one layer's weights in bf16
    print(f"FSDP gathers one layer at a time to compute, {fsdp['at once'] / GB:.3f} GB: "
          f"{fsdp['at once'] == one}")
    tracker = next(iter(fsdp["tracker"].values()))
    kinds = {k.value: v for k, v in tracker.items() if k != "Total"}
    agree = (kinds["Sharded Param"], kinds["Sharded Grad"]) == (fsdp["weights"],
                                                                fsdp["gradients"])
    print(f"torch's FSDPMemTracker (private) after the step: sharded weights and gradients as "
          f"measured: {agree}; Adam's state {kinds['OptState'] - fsdp['optimizer']:,.0f} bytes "
          f"more, its {LAYERS} step counts (4 bytes each): "
          f"{kinds['OptState'] - fsdp['optimizer'] == 4 * LAYERS}")
    control = states("FSDP2, the root only")
    print(f"control, FSDP without a unit per layer: {control['at once'] / GB:.3f} GB gathered at "
          f"once, the whole model in bf16 (2 Psi), not one layer: caught: "
          f"{control['at once'] == 2 * PSI}")


if __name__ == "__main__":
    main()
