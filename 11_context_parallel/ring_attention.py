"""Lesson 11's idea: context parallelism, one sequence split over the ranks, and causal attention
computed by passing the keys and values around a ring.

sequence_chunks says which tokens a rank holds: with N ranks the sequence is cut into 2N chunks
and rank r holds chunks r and 2N - 1 - r (balanced: under the causal mask every rank has the
same work), or, unbalanced, chunks 2r and 2r + 1. block_scores masks one block's scores
causally; attend_block computes the attention of some queries to one block of keys and values,
with the log-sum-exp of each query's scores; merge adds two such partial results into one (the
online softmax); attend_chunks does it for a rank's two chunks of queries and a block's two of
keys, and block_gradients is its backward. RingAttention is the autograd Function: at each step
forward starts sending the block of keys and values it holds to the next rank (ring_pass,
batch_isend_irecv, which returns at once), attends to it while it travels, then waits for the
previous rank's; backward passes the blocks around again, and each block's gradients after it,
which come home to their rank after N passes.
"""

import math

import torch
import torch.distributed as dist


def sequence_chunks(rank, cp, balanced=True):
    """The chunks (of 2 * cp) that rank holds, in order: [r, 2cp - 1 - r], or [2r, 2r + 1]."""
    return [rank, 2 * cp - 1 - rank] if balanced else [2 * rank, 2 * rank + 1]


def local_part(x, rank, cp, balanced=True, dim=1):
    """This rank's tokens of x (its sequence along dim), its chunks side by side."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in sequence_chunks(rank, cp, balanced)], dim=dim)


def block_scores(q, k, q_chunk, k_chunk):
    """The scores of chunk q_chunk's queries for chunk k_chunk's keys, causally masked, or None
    where the mask hides the whole block (a later chunk of keys). q, k: [batch, heads, chunk
    length, head dim]."""
    if k_chunk > q_chunk:
        return None
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if k_chunk == q_chunk:  # the same positions: each query sees the keys up to its own
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    return scores


def attend_block(q, k, v, q_chunk, k_chunk):
    """Queries of chunk q_chunk attending to keys and values of chunk k_chunk: (output,
    log-sum-exp of each query's scores), or None where the mask hides the whole block."""
    scores = block_scores(q, k, q_chunk, k_chunk)
    if scores is None:
        return None
    lse = scores.logsumexp(dim=-1, keepdim=True)
    return (scores - lse).exp() @ v, lse


def merge(out, lse, block):
    """Two partial attentions of the same queries (to different keys) into one: each output
    weighted by its share of the softmax's denominator, exp(lse_i - lse)."""
    if block is None:
        return out, lse
    block_out, block_lse = block
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    return (lse - new_lse).exp() * out + (block_lse - new_lse).exp() * block_out, new_lse


def attend_chunks(outs, lses, q, q_chunks, k, v, k_chunks):
    """Merge into outs and lses (one of each per query chunk) the attention of q's two chunks
    (q_chunks) to the two of k and v (k_chunks)."""
    for i, (qc, q_part) in enumerate(zip(q_chunks, q.chunk(2, dim=2), strict=True)):
        for kc, k_part, v_part in zip(k_chunks, k.chunk(2, dim=2), v.chunk(2, dim=2), strict=True):
            outs[i], lses[i] = merge(outs[i], lses[i], attend_block(q_part, k_part, v_part, qc, kc))


def block_gradients(pieces, k, v, k_chunks):
    """This rank's share of the gradients of one block of keys and values (k and v, chunks
    k_chunks). pieces: for each of its two chunks of queries, the chunk, its q, grad_out, lse
    and delta, and its part of grad_q, to which the block's share is added."""
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    for qc, q_part, go_part, lse_part, delta_part, gq_part in pieces:
        scale = 1 / math.sqrt(q_part.shape[-1])
        for kc, k_part, v_part, gk_part, gv_part in zip(
                k_chunks, k.chunk(2, dim=2), v.chunk(2, dim=2), grad_k.chunk(2, dim=2),
                grad_v.chunk(2, dim=2), strict=True):
            scores = block_scores(q_part, k_part, qc, kc)  # again: none were kept
            if scores is None:
                continue
            probs = (scores - lse_part).exp()  # this block's share of the softmax
            gv_part.add_(probs.transpose(-2, -1) @ go_part)
            grad_scores = probs * (go_part @ v_part.transpose(-2, -1) - delta_part)
            gq_part.add_(grad_scores @ k_part * scale)
            gk_part.add_(grad_scores.transpose(-2, -1) @ q_part * scale)
    return grad_k, grad_v


def ring_pass(tensors, group):
    """Start one step of the ring: send tensors to the next rank, receive the previous rank's.
    It returns at once, with a function that waits for them and returns them: this rank
    computes while they travel."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tensors = [t.contiguous() for t in tensors]  # sends take whole blocks of memory
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(rank - 1) % size)
            for t in received]
    works = dist.batch_isend_irecv(ops)

    def arrived():
        while works:  # the sends too; each let go once done, and with it the block it sent
            works.pop().wait()
        return received

    return arrived


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to every rank's keys and values, passed around
    the ring; each rank holds its two chunks (sequence_chunks) side by side."""

    @staticmethod
    def forward(ctx, q, k, v, group, balanced):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        outs, lses = [None, None], [None, None]
        kv = (k, v)
        for step in range(cp):
            if step < cp - 1:  # they go on to the next rank while this one attends to them
                next_kv = ring_pass(kv, group)
            source = (rank - step) % cp  # whose keys and values this rank holds now
            attend_chunks(outs, lses, q, sequence_chunks(rank, cp, balanced), *kv,
                          sequence_chunks(source, cp, balanced))
            if step < cp - 1:
                kv = next_kv()
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced = group, balanced
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, balanced = ctx.group, ctx.balanced
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        # Softmax's backward needs, per query, the sum of grad_out * out over its features.
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        pieces = list(zip(sequence_chunks(rank, cp, balanced), q.chunk(2, dim=2),
                          grad_out.chunk(2, dim=2), lse.chunk(2, dim=2), delta.chunk(2, dim=2),
                          grad_q.chunk(2, dim=2), strict=True))
        kv, earlier_grads = (k, v), None
        for step in range(cp):
            if step < cp - 1:  # the keys and values go on while this rank computes
                next_kv = ring_pass(kv, group)
            source = (rank - step) % cp
            grad_k, grad_v = block_gradients(pieces, *kv, sequence_chunks(source, cp, balanced))
            if earlier_grads:  # add them to the shares of the ranks before, arrived meanwhile
                earlier_k, earlier_v = earlier_grads()
                grad_k, grad_v = earlier_k.add_(grad_k), earlier_v.add_(grad_v)
            if cp > 1:  # the gradients follow their block: the next rank holds it next
                earlier_grads = ring_pass((grad_k, grad_v), group)
            if step < cp - 1:
                kv = next_kv()
        if cp > 1:  # the last pass brings each rank its own block's gradients, summed
            grad_k, grad_v = earlier_grads()
        return grad_q, grad_k, grad_v, None, None


def ring_attention(q, k, v, group, balanced=True):
    return RingAttention.apply(q, k, v, group, balanced)
