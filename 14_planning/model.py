"""The course's GPT at real sizes: lesson 13's TinyGPT, made configurable to Llama 3 and GPT-3.

The names are lesson 13's, so that its parallelize.py applies unchanged: tokens and positions
(the embeddings; positions None with rotary positions), blocks (a ModuleDict, so blocks.7 keeps its
name on the stage that holds it), each with norm1, attn (q, k, v and out, separate layers for TP),
norm2, fc1 and fc2; then norm and head. A pipeline stage is this model with parts set to None.

    CONFIGS["tiny"]          lesson 13's model, exactly (its parameters and its forward)
    CONFIGS["gpt3-175b"]     GPT-3 175B as Korthikanti et al. (2022) count it: h 12,288, 96 heads,
                             96 layers, s 2,048, vocabulary 51,200, a GeLU MLP of 4h, dropout 0.1,
                             attention written out (scores, softmax, dropout): their Table 3
    CONFIGS["llama3-8b"]     Llama 3 8B, 70B and 405B as the Llama 3 paper's Table 3 and the
    CONFIGS["llama3-70b"]    released config.json files give them: grouped-query attention with 8
    CONFIGS["llama3-405b"]   key/value heads, SwiGLU, RMSNorm (eps 1e-5), RoPE (theta 500,000),
                             no biases, the head not tied to the embeddings, a vocabulary of
                             128,256 (Table 3's 128,000 tokens, and 256 reserved for special ones,
                             as the released weights have): 8.03, 70.55 and 405.85 B parameters

What differs from the real models, none of it in the bytes a rank holds or saves:
- SwiGLU's two input layers (Llama's w1 and w3) are one fc1 of 2 x hidden outputs, gate and up
  interleaved (unit i's gate, then its up), so that TP's column-wise split, which gives each rank a
  contiguous block of rows, gives it both halves of the same hidden units; Llama's w2 is fc2.
- RoPE turns the two halves of each head (Hugging Face's layout); Meta's code turns neighbouring
  pairs. The same tensors, the same bytes.
- GPT-3's head is a weight of its own, as on Megatron's last pipeline stage (a copy of the
  embeddings whose gradients Megatron adds to the first stage's); q, k and v have no bias (lesson
  13's reason, below): 3 h numbers a layer fewer than Megatron's.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    heads: int
    layers: int
    hidden: int  # the MLP's hidden units
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    seq_len: int = 0  # learned positions for sequences up to this long; 0: rotary (RoPE)
    swiglu: bool = False  # SwiGLU (Llama) instead of GeLU
    rms: bool = False  # RMSNorm (Llama) instead of LayerNorm
    bias: bool = True  # biases on out, fc1, fc2 and the head
    dropout: float = 0.0  # on attention's scores, attention's output and the MLP's (GPT-3)
    explicit: bool = False  # attention written out, as Korthikanti et al. count it; else SDPA
    theta: float = 500000.0  # RoPE's base


LLAMA = dict(vocab=128256, kv_heads=8, swiglu=True, rms=True, bias=False)
CONFIGS = {
    "tiny": Config(vocab=13, dim=32, heads=4, layers=4, hidden=128, seq_len=64),
    "gpt3-175b": Config(vocab=51200, dim=12288, heads=96, layers=96, hidden=4 * 12288,
                        seq_len=2048, dropout=0.1, explicit=True),
    "llama3-8b": Config(dim=4096, heads=32, layers=32, hidden=14336, **LLAMA),
    "llama3-70b": Config(dim=8192, heads=64, layers=80, hidden=28672, **LLAMA),
    "llama3-405b": Config(dim=16384, heads=128, layers=126, hidden=53248, **LLAMA),
}


def rotate(x, positions, theta):
    """RoPE: each head's two halves, feature pair i turned by position x theta^(-i / half)."""
    half = x.shape[-1] // 2
    frequencies = theta ** -(torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = (positions[:, None].float() * frequencies).to(x.dtype)  # [tokens, half]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def explicit_attention(q, k, v, dropout, training):
    """Causal attention as Korthikanti et al. count it: the scores, their softmax (saved), its
    dropout (a mask), and the dropped-out weights times the values. An additive mask, not
    masked_fill: an addition's backward needs neither input, so it saves nothing."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    t = q.shape[-2]
    scores = scores + torch.full((t, t), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
    return F.dropout(scores.softmax(-1), dropout, training) @ v


class Attention(nn.Module):
    """Causal self-attention, with q, k and v each its own layer: TP splits each by its output
    columns, whole heads to a rank (lesson 11's one qkv layer, split so, would give the first
    rank all of q and none of v). With grouped-query attention k and v have kv_heads heads."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.dim // config.heads
        kv_dim = (config.kv_heads or config.heads) * self.head_dim
        # No bias on q, k, v: a key bias adds q . b to all of a query's scores, which softmax
        # cancels, so its gradient is 0 but for rounding, and Adam turns rounding into steps.
        self.q = nn.Linear(config.dim, config.dim, bias=False)
        self.k, self.v = (nn.Linear(config.dim, kv_dim, bias=False) for _ in range(2))
        self.out = nn.Linear(config.dim, config.dim, bias=config.bias)
        self.selective = False  # recompute the attention proper in backward (set by the plan)
        self.positions = None  # this rank's token positions; None: 0, 1, ... (CP sets them)

    def attend(self, q, k, v):
        """Attention proper, from q, k, v to each query's weighted values (under context
        parallelism, fake_ranks.context_parallel puts its own in its place)."""
        if self.config.explicit:
            return explicit_attention(q, k, v, self.config.dropout, self.training)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def forward(self, x):
        batch, tokens, _ = x.shape
        # -1 heads: the ones this rank holds, all of them on one process, heads / tp under TP
        q, k, v = (f(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        if not self.config.seq_len:  # rotary positions: turn q and k by each token's position
            where = torch.arange(tokens, device=x.device) if self.positions is None else (
                self.positions)
            q, k = rotate(q, where, self.config.theta), rotate(k, where, self.config.theta)
        if self.selective:  # Korthikanti et al.'s selective recomputation: keep q, k, v only
            y = checkpoint(self.attend, q, k, v, use_reentrant=False)
        else:
            y = self.attend(q, k, v)
        y = self.out(y.transpose(1, 2).reshape(batch, tokens, -1))
        return F.dropout(y, self.config.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        norm = nn.RMSNorm if config.rms else nn.LayerNorm
        self.config = config
        self.norm1, self.attn = norm(config.dim, eps=1e-5), Attention(config)
        self.norm2 = norm(config.dim, eps=1e-5)
        wide = 2 * config.hidden if config.swiglu else config.hidden  # SwiGLU: gate and up
        self.fc1 = nn.Linear(config.dim, wide, bias=config.bias)
        self.fc2 = nn.Linear(config.hidden, config.dim, bias=config.bias)
        self.full = False  # recompute the whole block in backward (set by the plan)

    def mlp(self, x):
        if self.config.swiglu:  # fc1's outputs alternate gate and up, unit by unit
            gate, up = self.fc1(x).unflatten(-1, (-1, 2)).unbind(-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(self.fc1(x))
        return F.dropout(self.fc2(x), self.config.dropout, self.training)

    def layer(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def forward(self, x):
        if self.full:  # full recomputation: keep the block's input only
            return checkpoint(self.layer, x, use_reentrant=False)
        return self.layer(x)


class GPT(nn.Module):
    """Tokens -> embeddings (of the token, and of its position unless RoPE turns q and k) ->
    pre-norm blocks -> a score for every next token. A pipeline stage is this model with some
    parts deleted (lesson 13's keep_stage): its forward runs the parts it has."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq_len, config.dim) if config.seq_len else None
        # A dict, not a list: blocks.2 keeps its name on the stage that holds it alone
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        norm = nn.RMSNorm if config.rms else nn.LayerNorm
        self.norm = norm(config.dim, eps=1e-5)
        self.head = nn.Linear(config.dim, config.vocab, bias=config.bias)

    def forward(self, x):
        if self.tokens is not None:  # the first stage: tokens in
            tokens = x
            x = self.tokens(tokens)
            if self.positions is not None:
                x = x + self.positions(torch.arange(tokens.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:  # the last stage: scores out
            x = self.head(self.norm(x))
        return x
