"""Lesson 14's idea: any rank of a real-sized model's layout, built as that rank builds it with
lesson 13's parallelize.py, and one training step of it run and measured, never allocated, in
PyTorch's fake process group (this process is rank r of N; a collective moves nothing) under
FakeTensorMode (tensors with shapes and dtypes, and no memory): Llama 3 405B on a laptop.

    Layout      dp x pp x tp x cp, the micro-batches, FSDP's way, recomputation, the schedule
    build       a stage: keep_stage, tensor_parallel, context parallelism, FSDP or DDP
    train_step  one step, GPipe's order, counting what it saves and sends (measure.py)

The fake tensors claim the CPU (autograd cannot run backward on fake CUDA tensors without a
GPU); where the CPU's kernels save other tensors than a GPU's, gpu_kernels runs CUDA's.
"""

import contextlib
import dataclasses
import logging
import warnings
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from measure import CountCollectives, NewStorages, SavedBytes, gathered, local_bytes
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._composable.replicate_with_fsdp import replicate  # DDP, on FSDP2's code
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" group

from model import GPT
from parallelize import build_mesh, clip_whole_model, keep_stage, tensor_parallel

# Lesson 13's plan names a position embedding, which rotary positions lack; FSDP warns that a TP
# layer's output is a view (the model changes none in place); a 2-D clip logs 2 all-reduces.
warnings.filterwarnings("ignore", message="Parallelize plan key 'positions' could not be")
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    microbatches: int = 1  # m: micro-batches a step, on each dp rank
    batch: int = 1  # sequences in a micro-batch
    seq_len: int = 2048  # tokens in a sequence
    data: str = "fsdp"  # "fsdp": lesson 13's; "kept": gathered from forward to backward; "ddp"
    recompute: str = "none"  # "selective": attention proper; "full": each block
    schedule: str = "1f1b"  # or "gpipe", lesson 13's: every forward first
    bf16: bool = True  # bf16 compute, float32 weights and gradients; False: float32 throughout
    world = property(lambda self: self.dp * self.pp * self.tp * self.cp)  # the ranks in all


@contextlib.contextmanager
def as_rank(rank, world):
    """This process as rank `rank` of `world`, in the fake process group."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor caches by mesh, and meshes of the same ranks compare equal: clear its cache
        _clear_sharding_prop_cache()


class RMSNormAsOnGpu(torch.autograd.Function):
    """RMSNorm as CUDA's fused kernel runs it: it saves the input and 1 / RMS of each token."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):  # in float32, as the kernel computes
        x, weight, rstd = ctx.saved_tensors
        normed, scaled = x.float() * rstd, grad.float() * weight.float()
        dx = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        dw = (grad.float() * normed).sum(dim=tuple(range(x.dim() - 1)))
        return dx.to(x.dtype), None, dw.to(weight.dtype), None


@contextlib.contextmanager
def gpu_kernels():
    """Dropout and RMSNorm as CUDA runs them, swapped in torch.nn.functional for the span: a
    one-byte mask, where the CPU keeps one in the input's dtype; the input and 1 / RMS, where
    the CPU keeps 3 float32 copies. (LayerNorm's 2 statistics a token: the CPU's bf16, CUDA's
    float32.)"""

    def dropout(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, True)[0] if training and 0 < p < 1 else x

    def rms_norm(x, shape, weight=None, eps=None):
        return RMSNormAsOnGpu.apply(x, shape, weight, eps)

    with mock.patch.object(F, "dropout", dropout), mock.patch.object(F, "rms_norm", rms_norm):
        yield


def context_parallel(model, group, layout):
    """Llama 3's context parallelism: the sequence in 2 cp chunks, rank c holding chunks c and
    2 cp - 1 - c (the same work for each under the causal mask); each attention gathers k and v
    (small: 8 key/value heads) and masks them by position, one mask for every layer (2 s^2 / cp
    bytes, which a production kernel does without)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = torch.arange(layout.seq_len).chunk(2 * cp)
    mine = torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])
    everyone = torch.cat([torch.cat([chunks[c], chunks[2 * cp - 1 - c]]) for c in range(cp)])
    mask = torch.where(everyone[None, :] > mine[:, None], float("-inf"), 0.0)  # later keys
    mask = mask.to(torch.bfloat16) if layout.bf16 else mask

    def attend(q, k, v):
        k, v = (funcol.all_gather_single_autograd(t.contiguous(), gather_dim=2, group=group)
                for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=k.shape[1] != q.shape[1])

    for block in model.blocks.values():
        block.attn.positions, block.attn.attend = mine, attend


def data_parallel(model, dp_mesh, layout):
    """FSDP2, each block a unit, gathered for each forward (lesson 13's) or "kept" from forward
    to backward (Llama 3's, torchtitan's under PP); or DDP: every weight whole on every rank."""
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = {"mp_policy": mixed} if layout.bf16 else {}
    if layout.data == "ddp":
        for block in model.blocks.values():
            replicate(block, mesh=dp_mesh, **options)
        return replicate(model, mesh=dp_mesh, **options)
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=layout.data == "fsdp", **options)
    return fully_shard(model, mesh=dp_mesh, **options)


def make_groups(layout):
    """Lesson 13's (pp, dp, tp) mesh, dp x cp ranks along dp (FSDP shards over both), and the cp
    group, neighbours along dp: made outside the fake mode, as a mesh computes with its ranks."""
    mesh = build_mesh("cpu", layout.dp * layout.cp, layout.pp, layout.tp, timeout=60)
    cp_group = None
    for first in range(0, layout.world if layout.cp > 1 else 0, layout.tp * layout.cp):
        for t in range(first, first + layout.tp):
            ranks = list(range(t, first + layout.tp * layout.cp, layout.tp))
            group = dist.new_group(ranks)
            cp_group = group if dist.get_rank() in ranks else cp_group
    return mesh, cp_group


def build(config, layout, stage, blocks, mesh, cp_group, mode):
    """Stage `stage` with `blocks` blocks, as its ranks build it: a model of pp x blocks blocks,
    of which keep_stage leaves the stage its own; then TP, CP and FSDP (or DDP)."""
    with mode:
        model = GPT(dataclasses.replace(config, layers=layout.pp * blocks))
    keep_stage(model, stage, layout.pp)
    for block in model.blocks.values():
        block.attn.selective, block.full = (layout.recompute == r for r in ("selective", "full"))
    if layout.tp > 1:
        tensor_parallel(model, mesh["tp"])
    if layout.cp > 1:
        with mode:
            context_parallel(model, cp_group, layout)
    data_parallel(model, mesh["dp"], layout)
    return model


def train_step(model, layout, stage, config, counter):
    """One step in GPipe's order (lesson 10): each micro-batch's forward, its output sent on,
    then each backward, its input's gradient sent back, reduced in the last only (torch's
    schedules have FSDP accumulate them, whole, before); lesson 13's clip, Adam. Rank 0 plays
    each stage's first rank (they differ only in the pipeline coordinate, which keep_stage was
    given), any other rank its neighbour: nothing moves."""
    first, last, pp = stage == 0, stage == layout.pp - 1, counter.groups["pp"]
    saved, pairs, held = SavedBytes(), [], {}
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)  # as on GPUs; the same state
    for i in range(layout.microbatches):
        counter.phase = f"F{i + 1}"
        if first:
            x = torch.randint(config.vocab, (layout.batch, layout.seq_len // layout.cp))
        else:
            x = torch.empty(layout.batch, layout.seq_len // layout.cp // layout.tp, config.dim,
                            dtype=torch.bfloat16 if layout.bf16 else torch.float32)  # its tokens
            dist.recv(x, group=pp, group_src=1)
            x.requires_grad_()
        with saved.micro_batch():
            y = model(x)
            if last:  # the sum of the micro-batch's losses, in float32 as torchtitan has it
                y = F.cross_entropy(y.flatten(0, 1).float(), torch.zeros(
                    y.shape[0] * y.shape[1], dtype=torch.long), reduction="sum")
        if not last:
            dist.send(y.detach(), group=pp, group_dst=1)
        pairs.append((x, y))
    held["gathered"] = gathered(model)  # FSDP's units still gathered after the forwards
    for i, (x, y) in enumerate(pairs):
        counter.phase = f"B{i + 1}"
        model.set_requires_gradient_sync(i == len(pairs) - 1)  # as the schedules: the last
        model.set_reshard_after_backward(i == len(pairs) - 1)  # backward reduces, reshards
        with NewStorages() as new:
            y.backward(None if last else torch.empty_like(y))
        if i == 0:  # what the first backward leaves held, but gathered weights: the gradients
            held["accumulated"] = new.live(besides=[*model.parameters(), x.grad])
        if not first:
            dist.send(x.grad, group=pp, group_dst=1)
    counter.phase = "step"
    clip_whole_model(model.parameters(), 1.0, pp)
    optimizer.step()
    counter.phase = None  # the step is over: what follows measures, and sends nothing counted
    held["gradients"] = local_bytes(p.grad for p in model.parameters())  # the step's, sharded
    if layout.data == "fsdp":  # one block, as FSDP gathers it to compute
        block = next(iter(model.blocks.values()))
        block.unshard()
        held["block"] = local_bytes(block.parameters())
        block.reshard()
    held["weights"] = local_bytes(model.parameters())
    held["optimizer"] = local_bytes(t for s in optimizer.state.values() for t in s.values()
                                    if t.dim() > 0)
    return held, saved.bytes


def run(config, layout, stage, blocks, mesh, cp_group):
    """Stage `stage` built with `blocks` blocks, one step: what it holds, saves and sends."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build(config, layout, stage, blocks, mesh, cp_group, mode)
    groups = {name: mesh[name].get_group() for name in ("pp", "dp", "tp")}
    counter = CountCollectives(groups | ({"cp": cp_group} if cp_group else {}))
    with mode, gpu_kernels(), counter:
        held, saved = train_step(model, layout, stage, config, counter)
    return held, saved, counter
