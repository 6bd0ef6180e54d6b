"""Lesson 12's proof: the mixture of experts by hand, on one process and on --ep ranks, equal to
every expert run on every token.

It starts --ep ranks (gloo, on the CPU). Every rank builds the same MoE layer and the same batch
of random tokens, in float64. The reference runs every expert on every token and adds, for each
token, its chosen experts' outputs times the router's weights: no sorting, no exchange. One
process's MoE.forward must equal it; then each rank keeps its experts (hold_experts) and its
share of the sequences, and its output, the gradients of its tokens, of the router and of its
experts must equal the reference's. Twice: top-2 with no capacity limit, and top-1 with a
capacity factor of 1, which drops tokens. Rank 0 prints the largest differences, the rows
each rank sends to each rank, and the bytes the exchanges move.

    python 12_expert_parallel/prove_experts.py            # 2 ranks
    python 12_expert_parallel/prove_experts.py --ep 4
"""

import argparse
import copy
import datetime
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experts import MoE, route
from guard_rails import spawn_guard

TOLERANCE = 1e-12  # float64: the same sums in another order differ by ~1e-15


def every_expert_on_every_token(moe, x):
    """The reference: each token's chosen, kept experts' outputs, times the router's weights."""
    _, weights, chosen = route(moe.router(x), moe.top_k)
    capacity = math.ceil(moe.capacity_factor * x.shape[1] * moe.top_k / moe.num_experts)
    kept = torch.zeros_like(chosen, dtype=torch.bool)  # each expert's first `capacity` choices
    for b, sequence in enumerate(chosen.tolist()):  # of each sequence, counted one by one
        taken = [0] * moe.num_experts
        for t, choices in enumerate(sequence):
            for j, e in enumerate(choices):
                kept[b, t, j] = not moe.capacity_factor or taken[e] < capacity
                taken[e] += int(kept[b, t, j])
    outputs = torch.stack([moe.experts[str(e)](x) for e in range(moe.num_experts)])
    y = torch.zeros_like(x)
    for j in range(moe.top_k):  # outputs[chosen[b, t, j], b, t] for every token
        pick = chosen[..., j][None, ..., None].expand(1, *x.shape)
        y = y + (weights[..., j] * kept[..., j])[..., None] * outputs.gather(0, pick)[0]
    return y


def largest_differences(moe, whole, x, grad_out, rank, ep):
    """Forward and backward on this rank's sequences through moe (one process's, or this rank's
    share of the experts); the largest difference from the reference on the whole batch."""
    per_rank = x.shape[0] // ep
    mine = x[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
    out = moe(mine)
    out.backward(grad_out[rank * per_rank:(rank + 1) * per_rank])
    router_grad = moe.router.weight.grad  # None if the loss does not reach the router
    router_grad = torch.zeros_like(moe.router.weight) if router_grad is None else router_grad
    if moe.ep_group is not None:  # the router is every rank's: its gradient is their sum
        dist.all_reduce(router_grad := router_grad.clone())
    reference = [t[rank * per_rank:(rank + 1) * per_rank] for t in (whole["out"], whole["x"])]
    diffs = [(out - reference[0]).abs().max(), (mine.grad - reference[1]).abs().max(),
             (router_grad - whole["router"]).abs().max()]
    diffs += [(param.grad - whole[f"experts.{name}"]).abs().max()
              for name, param in moe.experts.named_parameters()]
    diffs = torch.stack([d.detach() for d in diffs[:3]] + [torch.stack(diffs[3:]).max()])
    if moe.ep_group is not None:
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)  # the largest over the ranks
    return diffs, moe.load


def run(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ep,
                            timeout=datetime.timedelta(seconds=60))
    say = print if rank == 0 else lambda *_: None
    torch.set_default_dtype(torch.float64)
    equal = True
    for top_k, capacity_factor in ((2, 0), (1, 1.0)):
        torch.manual_seed(0)  # the same layer and tokens on every rank
        moe = MoE(args.dim, args.experts, top_k, capacity_factor)
        x = torch.randn(args.batch, args.seq_len, args.dim, requires_grad=True)
        grad_out = torch.randn(args.batch, args.seq_len, args.dim)
        reference = copy.deepcopy(moe)
        every_expert_on_every_token(reference, x).backward(grad_out)
        whole = {"out": every_expert_on_every_token(reference, x).detach(), "x": x.grad,
                 "router": reference.router.weight.grad} | {
            f"experts.{name}": param.grad for name, param in reference.experts.named_parameters()}
        x = x.detach()
        setting = f"top-{top_k}, capacity factor {capacity_factor or 'none'}"
        one = copy.deepcopy(moe)
        if rank == 0:  # one process, all the sequences
            diffs, _ = largest_differences(one, whole, x, grad_out, 0, 1)
            equal &= bool(diffs.max() < TOLERANCE)
            say(f"one process, {setting}: largest difference: output {diffs[0]:.1e}, "
                f"gradients of the tokens {diffs[1]:.1e}, router {diffs[2]:.1e}, experts "
                f"{diffs[3]:.1e}")
        moe.hold_experts(dist.group.WORLD)
        diffs, load = largest_differences(moe, whole, x, grad_out, rank, args.ep)
        equal &= bool(diffs.max() < TOLERANCE)
        say(f"--ep {args.ep}, {setting}: largest difference: output {diffs[0]:.1e}, gradients "
            f"of the tokens {diffs[1]:.1e}, router {diffs[2]:.1e}, experts {diffs[3]:.1e}")
        rows = torch.zeros(args.ep, args.ep, dtype=torch.int64)  # [from rank, to rank]
        rows[rank] = load.view(args.ep, -1).sum(dim=1)
        dist.all_reduce(rows)
        for source in range(args.ep):
            say(f"  rank {source} sends rows to ranks 0..{args.ep - 1}: "
                + ", ".join(str(n) for n in rows[source].tolist()))
        sent = (rows.sum() - rows.diagonal().sum()).item()  # rows that leave their rank
        kept_share = rows.sum().item() / (args.batch * args.seq_len * top_k)
        say(f"  kept {kept_share:.0%} of the choices; {sent} rows cross ranks, 4 times a step "
            f"(there and back, forward and backward): {4 * sent * args.dim * 8:,} bytes")
    say(f"equal within {TOLERANCE:g}: {equal}")
    dist.destroy_process_group()
    if not equal:
        sys.exit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=2, help="ranks that share the experts")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="sequences, split over the ranks")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--dim", type=int, default=8)
    args = parser.parse_args()
    if args.ep < 1 or args.experts % args.ep or args.batch % args.ep:
        sys.exit(f"error: --ep {args.ep} must divide --experts {args.experts} and --batch "
                 f"{args.batch}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    method = "spawn"  # macOS and Windows; on Linux the ranks fork from a server that has
    if sys.platform == "linux":  # imported torch once, as train.py's start_ranks does
        mp.set_forkserver_preload(["torch", "torch.distributed"])
        method = "forkserver"
    with spawn_guard("rank"):  # a rank that fails: one line, and the others stop
        mp.start_processes(run, args=(args, port), nprocs=args.ep, start_method=method)


if __name__ == "__main__":
    main()
