"""Lesson 13's model: lesson 11's tiny GPT, cut so that a mesh can split it. q, k and v are each
their own layer, so that TP splits them by heads (parallelize.py); the blocks are a dict, so that
a pipeline stage keeps its own under their names (keep_stage); each rank attends over its whole
sequences, no ring. Then how a language model is used: its loss, its greedy samples."""

import torch
import torch.nn.functional as F
from torch import nn

from data import VOCAB


class Attention(nn.Module):
    """Causal self-attention, with q, k and v each its own layer: TP splits each by its output
    columns, whole heads to a rank (lesson 11's one qkv layer, split so, would give the first
    rank all of q and none of v)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        # No bias on q, k, v: a key bias adds q . b to all of a query's scores, which softmax
        # cancels, so its gradient is 0 but for rounding, and Adam turns rounding into steps.
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, _ = x.shape
        # -1 heads: the ones this rank holds, all of them on one process, heads / tp under TP
        q, k, v = (f(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, -1))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    """Characters -> embeddings (of the character and of its position) -> pre-norm blocks ->
    a score for every next character. A pipeline stage is this model with some parts deleted
    (keep_stage): its forward runs the parts it has."""

    def __init__(self, seq_len, dim=32, heads=4, layers=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(len(VOCAB), dim), nn.Embedding(seq_len, dim)
        # A dict, not a list: blocks.2 keeps its name on the stage that holds it alone
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, len(VOCAB))

    def forward(self, x):
        if self.tokens is not None:  # the first stage: characters in
            x = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:  # the last stage: scores out
            x = self.head(self.norm(x))
        return x


def loss_sum(logits, targets):
    """The sum, not the mean, of the losses at predicting each target character from its
    scores: sums of different micro-batches' tokens add up to the whole batch's."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


@torch.no_grad()
def validation_loss(model, inputs, targets):
    """The mean loss over every validation token, on one process's model."""
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()


@torch.no_grad()
def complete(model, prompt, seq_len, device, limit=8):
    """The model's greedy continuation of prompt, up to the end of its line, on one rank."""
    ids = [VOCAB.index(c) for c in prompt]
    for _ in range(limit):
        logits = model(torch.tensor([ids[-seq_len:]], device=device))
        ids.append(int(logits[0, -1].argmax()))
        if VOCAB[ids[-1]] == "\n":
            break
    return "".join(VOCAB[i] for i in ids[len(prompt):]).rstrip("\n")
