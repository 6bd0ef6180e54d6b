"""Expert parallelism: the block's MLP becomes a mixture of experts, and the ranks of an EP group
share the experts out; each token travels to its experts' ranks and back by all-to-all.

Read it in this order:
    route            each token's top-k experts, and the router's weight for each
    within_capacity  which of those choices an expert takes (at most its capacity per sequence)
    MoE.forward      sort the choices by expert, run the experts, add each result to its token
    MoE.run_experts  with an EP group: counts, then rows, to the experts' ranks and back
    Exchange         the all-to-all, and its gradient: the same all-to-all the other way
    balance_loss     the Switch Transformer's load-balancing loss, per sequence
    gather_experts   at the end, every expert's weights from the ranks that hold them
    describe_load    the load line: the busiest expert, the busiest rank, the choices dropped

One process (no EP group) runs the same lines; its exchanges just keep what they are given.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One expert: lesson 11's MLP, now one of several."""

    def __init__(self, dim):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def route(scores, top_k):
    """scores: [..., experts], the router's. Each token's top_k experts and their weights: the
    router's probabilities of them, which sum to 1 over the chosen when top_k > 1 (Mixtral);
    with top_k = 1 the top probability itself (Switch), so the router still learns from the loss.
    """
    probs = scores.softmax(dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, chosen


def within_capacity(chosen, experts, capacity):
    """chosen: [batch, tokens, k]. True where the expert takes the choice: each expert takes the
    first `capacity` of its choices in each sequence, in token order (a token's first choice
    before its second), and drops the rest: their output is 0, and the residual carries the
    token on. Per sequence (GShard's groups), so one process and every --ep drop the same ones."""
    if capacity is None:
        return torch.ones_like(chosen, dtype=torch.bool)
    picks = F.one_hot(chosen, experts).flatten(1, 2)  # [batch, tokens * k, experts]
    place = (picks.cumsum(dim=1) * picks).sum(dim=-1)  # 1, 2, ...: its place in the queue
    return (place <= capacity).view_as(chosen)


def balance_loss(probs, chosen, experts):
    """The Switch Transformer's load-balancing loss (arXiv:2101.03961, eq. 4), summed over the
    sequences: experts x the sum over experts of (its share of the sequence's choices) x (its
    mean probability). 1 when every expert gets its share, up to `experts` when one gets all;
    an uneven load can also give less than 1, so its value is no measure of the imbalance.
    What works is its gradient: the shares are counts, with none, so it lowers each expert's
    mean probability in proportion to its share, the busiest expert's most.
    Per sequence (DeepSeek-V3's sequence-wise form), so the ranks' sums add up to one process's.
    """
    share = F.one_hot(chosen, experts).to(probs.dtype).mean(dim=(1, 2))  # [batch, experts]
    return experts * (share * probs.mean(dim=1)).sum()


class Exchange(torch.autograd.Function):
    """all_to_all_single with uneven splits: rows[:send[0]] go to rank 0 of the group, the next
    send[1] to rank 1, ...; receive[i] rows come from rank i. Backward sends each row's gradient
    back to the rank the row came from: the same all-to-all, with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        received = rows.new_empty(sum(receive), *rows.shape[1:])
        dist.all_to_all_single(received, rows.contiguous(), receive, send, group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        return Exchange.apply(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def exchange(rows, send, receive, group):
    return rows if group is None else Exchange.apply(rows, send, receive, group)


class MoE(nn.Module):
    """A router and `experts` experts; each token goes to its top_k of them. After
    hold_experts(group), this rank keeps only its share of the experts."""

    def __init__(self, dim, experts, top_k, capacity_factor=0):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(dim) for e in range(experts)})
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.ep_group = None  # one process: every expert here
        self.balance = self.load = None  # of the last forward: its balance loss, rows per expert

    def hold_experts(self, group):
        """Rank i of an EP group of N keeps experts i * E/N to (i + 1) * E/N - 1; the others
        live on the other ranks. Every rank built all E from the same seed, so each expert has
        the weights it has in one process."""
        self.ep_group = group
        per_rank = self.num_experts // dist.get_world_size(group)
        for e in range(self.num_experts):
            if e // per_rank != dist.get_rank(group):
                del self.experts[str(e)]

    def forward(self, x):
        batch, tokens, dim = x.shape
        probs, weights, chosen = route(self.router(x), self.top_k)
        self.balance = balance_loss(probs, chosen, self.num_experts)
        capacity = (math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
                    if self.capacity_factor else None)  # per expert and sequence
        kept = within_capacity(chosen, self.num_experts, capacity)
        # Every kept choice as (token, expert, weight), grouped by expert: expert 0's rows first.
        token = torch.arange(batch * tokens, device=x.device).view(batch, tokens, 1)
        token, expert, weight = token.expand_as(chosen)[kept], chosen[kept], weights[kept]
        order = expert.argsort(stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=self.num_experts)  # rows for each expert
        self.load = counts.detach()
        x = x.flatten(0, 1)
        y = self.run_experts(x[token], counts)  # row i: its expert's output for token[i]
        # Combine: each token gets the sum of its experts' outputs times the router's weights.
        return torch.zeros_like(x).index_add(0, token, y * weight[:, None]).view(batch, tokens, dim)

    def run_experts(self, rows, counts):
        """rows, grouped by expert (counts[e] of them for expert e) -> each row through its
        expert, in the same order; with an EP group, on the expert's rank and back."""
        group = self.ep_group
        ep = 1 if group is None else dist.get_world_size(group)
        received_counts = counts.clone()  # [source rank, my expert]: rows each sends each
        if group is not None:  # the counts first, so that each rank knows what it will get
            dist.all_to_all_single(received_counts, counts, group=group)
        send = counts.view(ep, -1).sum(dim=1).tolist()  # rows to each rank
        receive = received_counts.view(ep, -1).sum(dim=1).tolist()  # and from each rank
        received = exchange(rows, send, receive, group)  # by source rank, then by expert
        # Group what came from every rank by expert (stable: each source's rows keep their
        # order), run each expert on its rows, and put the results back in the received order.
        mine = list(self.experts.values())
        local = torch.arange(len(mine), device=rows.device).repeat(ep)
        by_expert = local.repeat_interleave(received_counts).argsort(stable=True)
        parts = received[by_expert].split(received_counts.view(ep, -1).sum(dim=0).tolist())
        outputs = torch.cat([expert(part) for expert, part in zip(mine, parts, strict=True)])
        return exchange(outputs[by_expert.argsort()], receive, send, group)


def gather_experts(model, group):
    """model's state dict, on the CPU, with every expert in it: each rank of the EP group sends
    the others its experts (all_gather_object, a few kilobytes here); the rest it holds."""
    mine = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, {n: t for n, t in mine.items() if ".experts." in n},
                           group=group)
    return {n: t for part in [mine, *every] for n, t in part.items()}


def describe_load(load, args):
    """load: [steps, blocks, experts], rows per expert. How much more than an even share the
    busiest expert got, and the busiest rank of an EP group (the rows of its --experts / --ep
    experts: the others wait for it), in the block where it is most; and the share of the
    choices dropped by the capacity limit. With --dp > 1, load is summed over the EP groups.
    args: the run's --ep, --batch-size, --seq-len and --top-k."""
    load = torch.as_tensor(load)
    per_expert = load.sum(dim=0).to(torch.float64)  # [blocks, experts]
    per_rank = per_expert.view(len(per_expert), args.ep, -1).sum(dim=2)  # [blocks, EP ranks]
    expert, rank = ((rows.max(dim=1).values / rows.mean(dim=1)).max()
                    for rows in (per_expert, per_rank))
    choices = load.shape[0] * args.batch_size * args.seq_len * args.top_k * load.shape[1]
    return (f"busiest expert {expert:.2f}x its share, busiest rank {rank:.2f}x, "
            f"{1 - per_expert.sum() / choices:.1%} dropped")
