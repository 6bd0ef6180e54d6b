"""Lesson 09: tensor parallelism, proved on one transformer block.

One pre-norm transformer block, built twice from the same seed: whole, as the reference, and
split over --tp ranks by parallelize_module with the plan torchtitan uses for a Llama block.
Attention is split by heads (q, k, v by columns, o by rows), the MLP by hidden units (w1 by
columns, w2 by rows); with sequence parallelism, the LayerNorms and residual adds work on each
rank's slice of the sequence. The run checks that the split block gives the reference's output
and gradients, counts the collectives of one step, and shows how one Adam step parts them.

Run it (on the CPU, over gloo; it starts its own --tp processes):
    python 09_tensor_parallel/transformer_block.py                     # 2 ranks, 4 heads
    python 09_tensor_parallel/transformer_block.py --tp 4 --heads 8 --seq 16
    python 09_tensor_parallel/transformer_block.py --control no-sequence-parallel  # plain TP
    python 09_tensor_parallel/transformer_block.py --control global-heads  # the pitfall: fails
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import guard_rails

# The same sums, added in another order: float32 rounds them ~1e-7 apart. Far below this.
TOLERANCE = 1e-5


class Attention(nn.Module):
    """Causal multi-head self-attention: each position sees itself and the ones before it."""

    def __init__(self, dim, heads, global_heads=False):
        super().__init__()
        self.heads, self.head_dim, self.global_heads = heads, dim // heads, global_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        batch, seq, width = q.shape
        # Under TP, q holds this rank's heads only (width = heads / tp * head_dim): count them
        # from it. The pitfall (--control global-heads) writes self.heads, all of them, here.
        heads = self.heads if self.global_heads else width // self.head_dim
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # each head on its own
        return self.o(out.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim, heads, global_heads=False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, heads, global_heads), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def tp_plan(between):
    """Which module is split how. Colwise: each rank holds some output features (whole heads,
    some hidden units) and needs the whole input. Rowwise: it holds the matching input
    features, so its output is a partial sum, which the ranks add up."""
    # attn and mlp take one whole input (from Shard(1): all-gathered), shared by q, k and v:
    # backward adds their input gradients on each rank and then reduces once, not 3 times.
    whole_input = PrepareModuleInput(input_layouts=between, desired_input_layouts=Replicate())
    plan = {"attn": whole_input, "mlp": whole_input, "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(), "mlp.w1": ColwiseParallel(),
            # The partial sums added: an all-reduce (Replicate), or a reduce-scatter (Shard(1))
            # that leaves each rank the sum of its slice only. With the all-gather after it,
            # the bytes of one all-reduce; but the norm and add between run on a slice.
            "attn.o": RowwiseParallel(output_layouts=between),
            "mlp.w2": RowwiseParallel(output_layouts=between)}
    if between == Shard(1):  # each rank normalizes its slice of the sequence, no other
        plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
    return plan


def count(comm_mode):
    """CommDebugMode's counts, per kind of collective, with 0 for each kind it did not see
    (tensor_parallel.py's count_collectives, here too: this file runs alone, and is exercise
    09's starting point)."""
    kinds = ("all-gather", "reduce-scatter", "all-reduce")
    counts = dict.fromkeys(kinds, 0)
    for op, n in comm_mode.get_comm_counts().items():
        name = str(op).replace("_", "")  # c10d.allreduce_, c10d._allgather_base_, ...
        for kind in kinds:
            if kind.replace("-", "") in name:
                counts[kind] += n
    return ", ".join(f"{kind} {n}" for kind, n in counts.items())


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # gathers a DTensor


@torch.no_grad()
def largest_difference(triples):
    """The largest |split - whole| over (name, split, whole) triples, and the name where it is."""
    return max((float((full(split) - whole).abs().max()), name) for name, split, whole in triples)


def run(rank, args):
    torch.set_num_threads(max(1, os.cpu_count() // args.tp))  # the ranks share the cores
    dist.init_process_group("gloo", rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=60))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # the ranks that split the block
    say = print if rank == 0 else lambda *_: None  # one copy of each line, not tp
    # Between blocks, with sequence parallelism: each rank's slice of the sequence (Shard(1)),
    # as the block before leaves it. Plain TP (Megatron-LM): all of it on every rank.
    between = Replicate() if args.control == "no-sequence-parallel" else Shard(1)
    reference, block = build_blocks(args, mesh, between)
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.dim)  # the same input on every rank
    x_here = x.chunk(args.tp, dim=1)[rank] if between == Shard(1) else x

    # The loss: the tokens' mean sum of squares. Each rank's is over the tokens it holds; with
    # Shard(1) they add up to the reference's. (Replicate: each rank holds all of it, once.)
    tokens = args.batch * args.seq
    reference_out = reference(x)
    (reference_out.pow(2).sum() / tokens).backward()
    out, forward, backward = split_forward_backward(block, x_here, tokens, args, say)
    out = DTensor.from_local(out, mesh, [between])  # this rank's part of the whole output
    params = [(name, p, whole) for (name, p), whole in
              zip(block.named_parameters(), reference.parameters(), strict=True)]
    equal = compare(out, reference_out, params, say)
    # Expected, Shard(1): forward all-gathers before attn and mlp (2) and reduce-scatters after
    # o and w2 (2); backward the reverse (2 and 2). Replicate: 2 all-reduces each way. The
    # LayerNorms' gradients stay partial sums until used (by full_tensor() in compare, or Adam).
    say(f"collectives in forward: {count(forward)}")
    say(f"collectives in backward: {count(backward)}")
    show_one_adam_step(reference, block, params, args, say)
    dist.destroy_process_group()
    if not equal:
        sys.exit(1)  # start_ranks sees the exit code


def build_blocks(args, mesh, between):
    """The reference block, whole, and the block split over the ranks: the same weights."""
    torch.manual_seed(0)  # the same seed: the same weights on every rank and in both blocks
    reference = Block(args.dim, args.heads)
    torch.manual_seed(0)
    block = Block(args.dim, args.heads, global_heads=args.control == "global-heads")
    parallelize_module(block, mesh, tp_plan(between))  # each rank keeps its slices
    return reference, block


def split_forward_backward(block, x_here, tokens, args, say):
    """The split block's forward and backward: (its output, and the CommDebugModes that counted
    the collectives of each)."""
    forward, backward = CommDebugMode(), CommDebugMode()  # they count the collectives
    try:
        with forward:
            out = block(x_here)
    except RuntimeError as error:  # on every rank alike, so none is left waiting for another
        say(f"forward of the split block failed: {error} "
            f"(each rank holds {args.heads // args.tp} of the {args.heads} heads)")
        # No rank leaves before rank 0 has said why: the launcher stops the others as soon as
        # one exits non-zero, and a rank 0 stopped before it printed would leave no reason.
        sys.stdout.flush()
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(1)
    with backward:
        (out.pow(2).sum() / tokens).backward()
    return out, forward, backward


def compare(out, reference_out, params, say):
    """Whether the split block's output and gradients are the reference's, within TOLERANCE."""
    forward_diff, _ = largest_difference([("out", out, reference_out)])
    grad_diff, where = largest_difference((n, p.grad, whole.grad) for n, p, whole in params)
    equal = forward_diff < TOLERANCE and grad_diff < TOLERANCE
    say(f"forward: largest difference {forward_diff:.1e}")
    say(f"gradients: largest difference {grad_diff:.1e} ({where})")
    say(f"equal within {TOLERANCE:g}: {equal}")
    return equal


def show_one_adam_step(reference, block, params, args, say):
    """How one Adam step parts the two blocks: by about lr on the k bias, whose gradient is
    rounding noise, and by rounding elsewhere."""
    # The k bias: adding b to every key adds q.b to all of a query's scores, which softmax
    # ignores. Its true gradient is 0; what is computed is rounding noise, unlike in each layout.
    noise = [full(m.attn.k.bias.grad).abs().max() for m in (reference, block)]
    say(f"k.bias gradient, largest magnitude: reference {noise[0]:.1e}, split {noise[1]:.1e}")
    # Adam divides each gradient by its own size: noise too becomes a step of about lr.
    for model in (reference, block):
        torch.optim.Adam(model.parameters(), lr=args.lr).step()
    k_diff, _ = largest_difference(t for t in params if t[0] == "attn.k.bias")
    rest_diff, _ = largest_difference(t for t in params if t[0] != "attn.k.bias")
    say(f"after one Adam step (lr {args.lr:g}): k.bias differs by {k_diff:.1e}, "
        f"every other parameter by at most {rest_diff:.1e}")
    # So a test compares gradients, not weights after Adam, or leaves the k bias out (Llama's
    # k has none). SGD steps by lr * gradient: with it, k.bias ends equal here (measured).

def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks that split the block")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's, for the k-bias demo")
    parser.add_argument("--control", default="none",
                        choices=["none", "global-heads", "no-sequence-parallel"],
                        help="global-heads: the head count hard-coded in .view (fails); "
                        "no-sequence-parallel: plain TP, all-reduces instead (passes)")
    args = parser.parse_args()
    # Checked before any rank starts: each rank holds whole heads and an equal slice.
    for flag in ("tp", "heads", "dim", "seq", "batch"):
        if getattr(args, flag) < 1:
            guard_rails.fail(f"--{flag} must be at least 1, not {getattr(args, flag)}")
    for flag, value in (("--heads", args.heads), ("--seq", args.seq)):
        if value % args.tp:
            guard_rails.fail(f"--tp {args.tp} does not divide {flag} {value}: each rank holds "
                             f"1/tp of the {flag[2:]}; use a --tp that divides {value}")
    if args.dim % args.heads:
        guard_rails.fail(f"--heads {args.heads} does not divide --dim {args.dim}")
    return args


def main():
    args = parse_args()
    port = guard_rails.find_free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # the ranks inherit it
    try:
        # mp.spawn(run, (args,), nprocs=args.tp), each rank forked from a server that has
        # imported this file, and with it torch and DTensor, once (lesson 02's README).
        guard_rails.start_ranks(run, (args,), args.tp, preload=["__main__"])
    except mp.ProcessExitedException:
        sys.exit(1)  # a rank stopped: rank 0 has said why


if __name__ == "__main__":
    main()
