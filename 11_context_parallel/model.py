"""Lesson 11's model, the course's first transformer: a tiny GPT that reads characters (data.py's
VOCAB) and scores every next one. Its attention is where context parallelism enters: with a CP
group, each rank holds two chunks of every sequence, and ring_attention.py brings the keys and
values of the others. Then how a language model is used: its loss, and its greedy samples."""

import torch
import torch.nn.functional as F
from torch import nn

from data import VOCAB
from ring_attention import attend_block, ring_attention


class Attention(nn.Module):
    """Causal self-attention. On one rank it attends within its tokens; with a CP group its
    tokens are two chunks of the sequence, and ring_attention brings every rank's keys."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        # No bias on q, k, v: a key bias adds q . b to all of a query's scores, which softmax
        # cancels, so its gradient is 0 but for rounding, and Adam turns rounding into steps.
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.cp_group = None  # set by use_cp_group

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        if self.cp_group is None:
            y = attend_block(q, k, v, 0, 0)[0]  # the whole sequence: one chunk, causal
        else:
            y = ring_attention(q, k, v, self.cp_group)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Characters -> embeddings (of the character and of its position) -> pre-norm blocks ->
    a score for every next character."""

    def __init__(self, seq_len, dim=32, heads=4, layers=2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(len(VOCAB), dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, len(VOCAB))

    def forward(self, ids, positions):
        """ids: [batch, tokens] characters; positions: [tokens], where they are in the sequence
        (with CP, this rank's two chunks)."""
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def use_cp_group(self, group):
        """Attend with the ring over group's ranks; None: on this rank alone."""
        for block in self.blocks:
            block.attn.cp_group = group


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
