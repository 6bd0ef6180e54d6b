"""Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
Table 2, measured: the bytes one GPT-3 layer saves for backward, at the paper's sizes (h 12,288,
a 96 heads, s 2,048 tokens, b 1, t 8 tensor-parallel ranks, 16-bit activations, one-byte dropout
masks), with no parallelism, TP, TP + SP, selective recomputation and full recomputation.

    python 14_planning/prove_activations.py

Each row builds the rank as fake_ranks.build does (lesson 13's tensor_parallel for TP + SP;
below, Megatron's TP without SP) on the fake process group, runs a forward of the model with one
layer and with two, and counts what autograd saves (measure.SavedBytes): the second layer's
share is one layer's. The fake tensors claim the CPU with a GPU's dropout (gpu_kernels); a
layer built plainly on fake CUDA tensors checks that: it saves the same, but for LayerNorm's
statistics, which CUDA keeps in float32. Each row must equal the paper's formula but for the
differences named beside it, to the byte; the controls must not.
"""

import contextlib
from unittest import mock

import fake_ranks
import torch
from fake_ranks import Layout, as_rank, build, gpu_kernels, make_groups
from measure import SavedBytes
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from model import CONFIGS, Block

GPT3 = CONFIGS["gpt3-175b"]
S, B, H, A, T = GPT3.seq_len, 1, GPT3.dim, GPT3.heads, 8
SBH, SB = S * B * H, S * B
GIB = 2 ** 30


def replicated(module, tp_mesh):
    """The module's weights whole on every tp rank, and its input and output each rank's whole
    tensor: a norm of Megatron's TP without SP."""
    distribute_module(module, tp_mesh,
                      input_fn=lambda _, inputs, mesh: DTensor.from_local(inputs[0], mesh),
                      output_fn=lambda _, output, mesh: output.to_local())


def without_sequence_parallel(model, tp_mesh):
    """Megatron's TP (Korthikanti et al.'s baseline): lesson 13's column-wise and row-wise splits,
    but each rank holds every token between them: the norms' and dropouts' inputs whole."""
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.out": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        replicated(block.norm1, tp_mesh)
        replicated(block.norm2, tp_mesh)
    parallelize_module(model, tp_mesh, {"tokens": RowwiseParallel(input_layouts=Replicate()),
                                        "head": ColwiseParallel(output_layouts=Replicate())})
    if model.positions is not None:  # learned positions (GPT-3): whole on every rank
        replicated(model.positions, tp_mesh)
    replicated(model.norm, tp_mesh)


def per_layer(tp, sp=True, recompute="none", gpu=True, config=GPT3, seq_len=S, cp=1):
    """Bytes one layer saves for backward in a rank of tp x cp ranks: the model built with two
    layers less the model built with one (the same embeddings and head in both)."""
    layout = Layout(tp=tp, cp=cp, seq_len=seq_len, recompute=recompute)
    counts = []
    with as_rank(0, layout.world):
        mesh, cp_group = make_groups(layout)
        for layers in (1, 2):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            plan = fake_ranks.tensor_parallel if sp else without_sequence_parallel
            with mock.patch.object(fake_ranks, "tensor_parallel", plan):
                model = build(config, layout, 0, layers, mesh, cp_group, mode)
            saved = SavedBytes()
            with mode, gpu_kernels() if gpu else contextlib.nullcontext(), saved.micro_batch():
                model(torch.randint(config.vocab, (B, seq_len // cp)))
            counts.append(saved.bytes[0])
    return counts[1] - counts[0]


def plain_layer(device):
    """Bytes one plain layer (no parallelism, no FSDP) saves, on fake tensors of `device`."""
    saved = SavedBytes()
    with FakeTensorMode(), torch.device(device):
        torch.set_default_dtype(torch.bfloat16)  # the paper's 16-bit weights and activations
        try:
            layer = Block(GPT3)
            x = torch.empty(B, S, H, requires_grad=True)
        finally:
            torch.set_default_dtype(torch.float32)
        with gpu_kernels() if device == "cpu" else contextlib.nullcontext(), saved.micro_batch():
            layer(x)
    return saved.bytes[0]


# Each row: the paper's configuration, how it is built, its formula (bytes, as in Table 2), and
# what PyTorch saves besides, with why. LayerNorm keeps a mean and 1 / deviation a token (2 sb
# numbers; the paper leaves them out, "2sb << sbh"), here in bf16: 2 norms x 2 x 2 bytes, over
# t under SP. PyTorch's SP keeps the inputs of q, k, v and of fc1 as TP gathers them, whole
# (2 sbh each), where Megatron keeps each rank's 2 sbh / t and gathers them again in backward.
STATS, GATHERED = 8 * SB, 4 * SBH * (1 - 1 / T)
ROWS = [
    ("no parallelism", dict(tp=1), SBH * (34 + 5 * A * S / H), STATS, "LayerNorm's statistics"),
    ("tensor parallel (baseline)", dict(tp=T, sp=False), SBH * (10 + 24 / T + 5 * A * S / (H * T)),
     STATS, "LayerNorm's statistics"),
    ("tensor + sequence parallel", dict(tp=T), SBH * (34 / T + 5 * A * S / (H * T)),
     STATS / T + GATHERED, "statistics; q, k, v's and fc1's inputs whole"),
    ("tensor parallel + selective recomputation", dict(tp=T, sp=False, recompute="selective"),
     SBH * (10 + 24 / T), STATS, "LayerNorm's statistics"),
    ("tensor + sequence parallel + selective", dict(tp=T, recompute="selective"),
     SBH * 34 / T, STATS / T + GATHERED, "statistics; q, k, v's and fc1's inputs whole"),
    ("full activation recomputation", dict(tp=T, sp=False, recompute="full"), SBH * 2, 0,
     "nothing"),
]


def main():
    print(f"GPT-3's layer: h {H:,}, {A} heads, s {S:,}, b {B}, t {T}; bytes it saves for "
          "backward (GiB = 2^30 bytes), the paper's formula beside the measurement:")
    exact = True
    for name, how, formula, besides, why in ROWS:
        measured = per_layer(**how)
        exact &= measured == formula + besides
        print(f"  {name:42} paper {formula / GIB:6.3f} | measured {measured / GIB:6.3f} | "
              f"{measured - formula:>11,.0f} bytes more: {why}")
    print(f"every row equals the formula plus what it names, to the byte: {exact}")
    cpu, cuda = plain_layer("cpu"), plain_layer("cuda")
    print(f"a plain layer on fake CUDA tensors saves {cuda - cpu:,} bytes more than on the CPU "
          f"with a GPU's dropout: LayerNorm's statistics in float32 ({STATS:,} more): "
          f"{cuda - cpu == STATS}")
    cpu_dropout = per_layer(1, gpu=False) - ROWS[0][2] - STATS
    print(f"control, dropout as the CPU keeps it (masks in bf16): {cpu_dropout:,.0f} bytes more, "
          f"a s^2 b + 2 sbh, a byte more for each masked number: caught: "
          f"{cpu_dropout == A * S * S * B + 2 * SBH}")
    name, _, formula, besides, _ = ROWS[2]
    off = per_layer(T, sp=False) - formula
    print(f"control, {name} built without SP: {off:,.0f} bytes more than the formula, not "
          f"{besides:,.0f}: caught: {off != besides}")


if __name__ == "__main__":
    main()
