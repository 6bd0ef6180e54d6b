"""Lesson 11's proof: ring attention, and the all-gather way, equal to full attention.

It starts --cp ranks (gloo, on the CPU). Each holds its two chunks of one batch of random queries,
keys and values, runs ring_attention and all_gather_attention forward and backward, and compares
its part of the output and of the three gradients with full causal attention
(F.scaled_dot_product_attention) on the whole sequence, in float64, where the only difference
left is the order of the sums. Rank 0 prints the largest difference of each, the blocks each
rank attends to (its work) in the balanced and the unbalanced layout, and the bytes each way
sends per rank.

    python 11_context_parallel/prove_ring.py            # 2 ranks
    python 11_context_parallel/prove_ring.py --cp 4
"""

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from guard_rails import spawn_guard
from ring_attention import all_gather_attention, local_part, ring_attention, sequence_chunks

TOLERANCE = 1e-12  # float64: the same sums in another order differ by ~1e-15


def work(rank, cp, balanced):
    """How many (query chunk, key chunk) blocks this rank computes: the causal mask hides a
    block whose keys come after its queries."""
    mine = sequence_chunks(rank, cp, balanced)
    every = [c for r in range(cp) for c in sequence_chunks(r, cp, balanced)]
    return sum(k <= q for q in mine for k in every)


def run(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.cp,
                            timeout=datetime.timedelta(seconds=60))
    say = print if rank == 0 else lambda *_: None
    generator = torch.Generator().manual_seed(0)  # the same tensors on every rank
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=generator, dtype=torch.float64)
                         for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True).backward(grad_out)
    reference_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    equal = True
    for name, attention in (("ring", ring_attention), ("all-gather", all_gather_attention)):
        for balanced in (True, False):
            mine = [local_part(t, rank, args.cp, balanced, dim=2).requires_grad_()
                    for t in (q, k, v)]
            out = attention(*mine, dist.group.WORLD, balanced)
            out.backward(local_part(grad_out, rank, args.cp, balanced, dim=2))
            parts = [(out, reference_out)] + [(m.grad, w.grad) for m, w in zip(mine, whole,
                                                                                strict=True)]
            diffs = torch.stack([(a - local_part(b, rank, args.cp, balanced, dim=2)).abs().max()
                                 for a, b in parts]).detach()
            dist.all_reduce(diffs, op=dist.ReduceOp.MAX)  # the largest over the ranks
            equal &= bool(diffs.max() < TOLERANCE)
            say(f"{name:10} {'balanced' if balanced else 'unbalanced':10} largest difference: "
                f"output {diffs[0]:.1e}, gradients of q {diffs[1]:.1e}, k {diffs[2]:.1e}, "
                f"v {diffs[3]:.1e}")
    say(f"equal within {TOLERANCE:g}: {equal}")
    for balanced in (True, False):
        say(f"blocks per rank, {'balanced' if balanced else 'unbalanced':10}: "
            + ", ".join(str(work(r, args.cp, balanced)) for r in range(args.cp)))
    # A rank's keys and values: its seq_len / cp tokens, float64. The ring sends them on cp - 1
    # times forward and again backward, and their gradients cp times; all-gather sends them to
    # the cp - 1 others, and their gradients back.
    kv = 2 * args.batch * args.heads * (args.seq_len // args.cp) * args.head_dim * 8
    say(f"bytes each rank sends in a forward and backward: ring {(3 * args.cp - 2) * kv:,}, "
        f"all-gather {2 * (args.cp - 1) * kv:,}; the most a rank holds of others' keys and "
        f"values: ring {kv:,} (the next block), all-gather {(args.cp - 1) * kv:,}")
    dist.destroy_process_group()
    if not equal:
        sys.exit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="ranks that split the sequence")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=8)
    args = parser.parse_args()
    if args.cp < 1 or args.seq_len % (2 * args.cp):
        sys.exit(f"error: --seq-len {args.seq_len} does not split into 2 x --cp = {2 * args.cp} "
                 "equal chunks (each rank holds two)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    method = "spawn"  # macOS and Windows; on Linux the ranks fork from a server that has
    if sys.platform == "linux":  # imported torch once, as train.py's start_ranks does
        mp.set_forkserver_preload(["torch", "torch.distributed"])
        method = "forkserver"
    with spawn_guard("rank"):  # a rank that fails: one line, and the others stop
        mp.start_processes(run, args=(args, port), nprocs=args.cp, start_method=method)


if __name__ == "__main__":
    main()
