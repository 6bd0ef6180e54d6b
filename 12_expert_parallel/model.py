"""Lesson 12's model: lesson 11's tiny GPT, on whole sequences again, with a mixture of experts
(experts.py) in place of every block's MLP: a router sends each token to its top-k experts. Its
attention is torch's, as this lesson has no ring. Then how a language model is used: its loss,
and its greedy samples."""

import torch
import torch.nn.functional as F
from torch import nn

from data import VOCAB
from experts import MoE


class Attention(nn.Module):
    """Causal self-attention, on whole sequences: torch's scaled_dot_product_attention, which
    computes what lesson 11's attend_block does (softmax(q k^T / sqrt(head dim)) v, each query
    seeing the keys up to its own) without the ring_attention.py this lesson has no use for."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        # No bias on q, k, v: a key bias adds q . b to all of a query's scores, which softmax
        # cancels, so its gradient is 0 but for rounding, and Adam turns rounding into steps.
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim, heads, moe):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, *moe)  # in place of lesson 11's MLP

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class TinyGPT(nn.Module):
    """Characters -> embeddings (of the character and of its position) -> pre-norm blocks ->
    a score for every next character."""

    def __init__(self, seq_len, dim=32, heads=4, layers=2, experts=4, top_k=2, capacity_factor=0):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(len(VOCAB), dim), nn.Embedding(seq_len, dim)
        moe = (experts, top_k, capacity_factor)  # every block's MoE layer's
        self.blocks = nn.ModuleList(Block(dim, heads, moe) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, len(VOCAB))

    def forward(self, ids, positions):
        """ids: [batch, tokens] characters; positions: [tokens], where they are in the sequence."""
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def hold_experts(self, group):
        """Keep this rank's share of every block's experts (experts.py)."""
        for block in self.blocks:
            block.moe.hold_experts(group)

    def balance_and_load(self):
        """The last forward's balance loss, summed over the blocks, and its rows per expert:
        [blocks, experts]."""
        moes = [block.moe for block in self.blocks]
        return sum(moe.balance for moe in moes), torch.stack([moe.load for moe in moes])


def loss_sum(model, ids, targets, positions):
    """The sum, not the mean, of the model's losses at predicting each target character: sums of
    different ranks' tokens add up to the whole batch's."""
    logits = model(ids, positions)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


@torch.no_grad()
def complete(model, prompt, seq_len, device, limit=8):
    """The model's greedy continuation of prompt, up to the end of its line, on one rank."""
    ids = [VOCAB.index(c) for c in prompt]
    for _ in range(limit):
        context = torch.tensor([ids[-seq_len:]], device=device)
        logits = model(context, torch.arange(context.shape[1], device=device))
        ids.append(int(logits[0, -1].argmax()))
        if VOCAB[ids[-1]] == "\n":
            break
    return "".join(VOCAB[i] for i in ids[len(prompt):]).rstrip("\n")
