"""Lesson 11's proof: ring attention, and the all-gather way, equal to full attention.

It starts --cp ranks (gloo, on the CPU). Each holds its two chunks of one batch of random queries,
keys and values, runs ring_attention and all_gather_attention (below: the other way, torch's
default) forward and backward, and compares its part of the output and of the three gradients
with full causal attention (F.scaled_dot_product_attention) on the whole sequence, in float64,
where the only difference left is the order of the sums. Rank 0 prints the largest difference
of each, then what it measured while they ran (Watch): the blocks each rank computes (its work)
in the balanced and the unbalanced layout, how many of them the ring computes while a pass
travels, and the most it holds at once of what the others sent it; and the bytes each way sends
per rank.

    python 11_context_parallel/prove_ring.py            # 2 ranks
    python 11_context_parallel/prove_ring.py --cp 4
"""

import argparse
import datetime
import os
import socket
import sys
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn.functional as F

import ring_attention
from guard_rails import spawn_guard
from ring_attention import attend_chunks, local_part, sequence_chunks

TOLERANCE = 1e-12  # float64: the same sums in another order differ by ~1e-15


def all_gather_attention(q, k, v, group, balanced=True):
    """The same attention, the other way: every rank gathers all keys and values (an all-gather
    that autograd follows: its backward sends each rank's gradients home, summed), then attends
    to them."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    gathered = [funcol.all_gather_single_autograd(t.contiguous(), gather_dim=0, group=group)
                .chunk(cp, dim=0) for t in (k, v)]  # along the batch: [rank 0's, rank 1's, ...]
    outs, lses = [None, None], [None, None]
    for source in range(cp):
        attend_chunks(outs, lses, q, sequence_chunks(rank, cp, balanced), gathered[0][source],
                      gathered[1][source], sequence_chunks(source, cp, balanced))
    return torch.cat(outs, dim=2)


class Watch:
    """Counts, on this rank, what ring_attention.py does: the blocks of scores it computes
    (block_scores that the mask does not hide), how many while a pass of the ring is on its way
    (started, not yet waited for), and the bytes it holds of what the others sent it: each
    tensor the ring receives into, and the others' part of what the all-gather gathers, from its
    arrival until the code lets it go (a weak reference says when)."""

    def __init__(self):
        self.blocks = self.overlapped = self.in_flight = self.now = self.base = self.most = 0
        self.scores, self.send_and_receive, self.gather = (
            ring_attention.block_scores, dist.batch_isend_irecv,
            funcol.all_gather_single_autograd)
        # ring_attention.py calls each through its module, so it calls these instead.
        ring_attention.block_scores = self.block_scores
        dist.batch_isend_irecv = self.ring_pass
        funcol.all_gather_single_autograd = self.all_gather

    def block_scores(self, *args):
        scores = self.scores(*args)
        self.blocks += scores is not None
        self.overlapped += scores is not None and self.in_flight > 0
        return scores

    def ring_pass(self, ops):
        for op in ops:
            if op.op is dist.irecv:
                self.hold(op.tensor, op.tensor.nbytes)
        works = self.send_and_receive(ops)
        self.in_flight += len(works)
        return [Waited(work, self) for work in works]

    def all_gather(self, tensor, *args, **kwargs):
        gathered = self.gather(tensor, *args, **kwargs)
        self.hold(gathered, gathered.nbytes - tensor.nbytes)  # all but this rank's own
        return gathered

    def hold(self, tensor, nbytes):
        self.now += nbytes
        self.most = max(self.most, self.now)
        weakref.finalize(tensor, self.let_go, nbytes)

    def let_go(self, nbytes):
        self.now -= nbytes

    def start(self):
        """Count from here: what is held already (an earlier run's gradients) is not counted."""
        self.blocks = self.overlapped = 0
        self.base = self.most = self.now

    def counts(self):
        """[blocks, of them while a pass travels, the most bytes held] since start() or the
        last counts(): forward's, then backward's (which includes what forward left held)."""
        counts = [self.blocks, self.overlapped, self.most - self.base]
        self.blocks = self.overlapped = 0
        self.most = self.now
        return counts


class Waited:
    """A pass's send or receive, which tells the Watch when it has been waited for."""

    def __init__(self, work, watch):
        self.work, self.watch = work, watch

    def wait(self):
        self.work.wait()
        self.watch.in_flight -= 1


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
    equal, watch, counts = True, Watch(), {}
    for name, attention in (("ring", ring_attention.ring_attention),
                            ("all-gather", all_gather_attention)):
        for balanced in (True, False):
            mine = [local_part(t, rank, args.cp, balanced, dim=2).requires_grad_()
                    for t in (q, k, v)]
            watch.start()
            out = attention(*mine, dist.group.WORLD, balanced)
            forward = watch.counts()
            out.backward(local_part(grad_out, rank, args.cp, balanced, dim=2))
            counts[name, balanced] = torch.tensor([forward, watch.counts()])
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
    for balanced in (True, False):  # the blocks the ring's forward computed on each rank
        work = [torch.zeros((), dtype=torch.int64) for _ in range(args.cp)]
        dist.all_gather(work, counts["ring", balanced][0, 0])
        say(f"blocks per rank, {'balanced' if balanced else 'unbalanced':10}: "
            + ", ".join(str(int(w)) for w in work))
    ring = counts["ring", True]  # [forward, backward] x [blocks, while a pass travels, bytes]
    say(f"blocks the ring computes while a pass travels: {ring[0, 1]} of {ring[0, 0]} in "
        f"forward, {ring[1, 1]} of {ring[1, 0]} in backward")
    # A block: one rank's keys and values, its seq_len / cp tokens, float64. The ring sends its
    # own on cp - 1 times forward and again backward, and their gradients cp times; all-gather
    # sends it to the cp - 1 others, and their gradients back.
    block = 2 * args.batch * args.heads * (args.seq_len // args.cp) * args.head_dim * 8
    say(f"bytes each rank sends in a forward and backward: ring {(3 * args.cp - 2) * block:,}, "
        f"all-gather {2 * (args.cp - 1) * block:,}")
    held = {name: torch.stack([counts[name, True], counts[name, False]]).amax(dim=0)[:, 2]
            for name in ("ring", "all-gather")}  # the most of either layout
    say(f"blocks of {block:,} bytes a rank holds at once of what the others sent it: "
        + "; ".join(f"{name} {held[name][0] / block:g} in forward, {held[name][1] / block:g} "
                    "in backward" for name in held))
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
