"""Lesson 13's idea: one model, three kinds of parallelism at once, each on its own dimension of
one device mesh. Read it in this order; each function is one step, and train.py calls them so.

    build_mesh          the ranks as a (pp, dp, tp) grid: who shares what with whom
    keep_stage          PP: this rank keeps its stage's blocks (lesson 10), the rest is deleted
    tensor_parallel     TP: each block's weights split by heads and by the MLP's hidden units,
                        with sequence parallelism on the norms (lesson 09)
    shard_data_parallel FSDP: what TP left, sharded once more over the dp ranks (lesson 07)
    pipeline_schedule   PP: the stage and its schedule, which runs the micro-batches (lesson 10)
    clip_whole_model    clipping by the whole model's gradient norm, not the stage's
    bytes_per_rank      what each rank holds of it all: the layout's memory, measured

The order of the middle three is not a choice: TP first, then FSDP (which shards the TP shards
along dp), then the pipeline stage around the sharded model. fully_shard before
parallelize_module fails: TP finds parameters already on the dp mesh, not plain tensors.
"""

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

DIMENSIONS = ("pp", "dp", "tp")  # the mesh's, outermost first (torchtitan's order)


def build_mesh(device_type, dp, pp, tp, timeout, first=0):
    """Rank r sits at (r // (dp * tp), r // tp % dp, r % tp) of a (pp, dp, tp) grid. torchrun
    numbers a node's ranks one after another, so the inner dimensions stay on a node: TP's
    collectives, 4 per block and micro-batch each way, on its fastest links; then dp, which
    carries FSDP's all-gathers of weights as well as its reduce-scatters of gradients (7 and 3
    of its 11 calls a step at 2 x 2 x 2, as benchmarks/capstone.py counts them). PP, outermost,
    crosses nodes first: it sends one activation per micro-batch to the next stage.
    With --dp 2 --pp 2 --tp 2: TP groups [0, 1] [2, 3] [4, 5] [6, 7], dp groups [0, 2] [1, 3]
    [4, 6] [5, 7], pipelines [0, 4] [1, 5] [2, 6] [3, 7]; on nodes of 4 GPUs, a stage a node.
    first: the mesh's lowest rank (the proofs run small meshes side by side in one launch); a
    rank outside the mesh makes its groups too, and gets None."""
    ranks = torch.arange(first, first + pp * dp * tp).view(pp, dp, tp)
    mine = {}
    # Every rank makes every group, in the same order (new_group is a collective of all), and
    # keeps its own. Not init_device_mesh: its groups wait torch's default (NCCL 10 min, gloo 30).
    for dim, name in enumerate(DIMENSIONS):
        for line in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]):  # a group a line
            group = dist.new_group(line.tolist(), timeout=datetime.timedelta(seconds=timeout))
            if dist.get_rank() in line:
                mine[name] = group
    if not mine:
        return None
    return DeviceMesh.from_group([mine[name] for name in DIMENSIONS], device_type, mesh=ranks,
                                 mesh_dim_names=DIMENSIONS)


def keep_stage(model, stage, stages):
    """Keep stage `stage` of `stages`: its share of the blocks, the embeddings on the first
    stage, the last norm and the head on the last. The names stay the whole model's
    (blocks.3 is blocks.3 on every stage), so a checkpoint loads into any other layout."""
    per_stage = len(model.blocks) // stages
    for name in list(model.blocks):
        if int(name) // per_stage != stage:
            del model.blocks[name]
    if stage > 0:
        model.tokens = model.positions = None
    if stage < stages - 1:
        model.norm = model.head = None
    return model


def tensor_parallel(model, tp_mesh):
    """Split each block over the tp ranks (lesson 09): column-wise by output features (the rows,
    dim 0, of the out x in weight nn.Linear stores), row-wise by input features. q, k and v
    column-wise, heads / tp whole heads to a rank, and out row-wise, whose partial sums meet in
    one reduce-scatter; fc1 column-wise, fc2 row-wise, the same. Between those pairs, in the
    norms and the residual stream, each rank holds 1/tp of the sequence (sequence parallelism):
    the norms' gradients, each rank's share, are summed over tp by DTensor."""
    sequence = Shard(1)  # [batch, tokens, dim]: split by token
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, {
            "norm1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(sequence,),  # all-gather the tokens
                                       desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.out": RowwiseParallel(output_layouts=sequence),
            "norm2": SequenceParallel(),
            "fc1": ColwiseParallel(input_layouts=sequence),  # all-gathers the tokens itself
            "fc2": RowwiseParallel(output_layouts=sequence),
        })
    ends = {}
    if model.tokens is not None:  # the first stage: both embeddings' sums, split by token
        ends["tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)
        # positions.weight is [tokens, dim]: its token dimension is 0, not 1
        ends["positions"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if model.head is not None:  # the last stage: every rank gets every token's scores
        ends["norm"] = SequenceParallel()
        ends["head"] = ColwiseParallel(input_layouts=sequence, output_layouts=Replicate())
    return parallelize_module(model, tp_mesh, ends)


def shard_data_parallel(model, dp_mesh):
    """FSDP2 over the dp ranks (lesson 07): each block its own unit, gathered just before each
    micro-batch's forward and freed after it, and once for backward; then the rest (embeddings,
    norm, head), the root's unit, gathered once a step. Each weight a rank holds is its TP shard,
    sharded again by dp; the gradients are averaged over dp, one reduce-scatter a unit."""
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def pipeline_schedule(model, mesh, device, schedule, microbatches, loss_fn):
    """This rank's stage of the pipeline, run by lesson 10's schedule over the pp ranks. Between
    stages go plain tensors, each this rank's tokens of the activation: a stage's last block
    ends in fc2's reduce-scatter by token, and the next stage's first norm takes its input so,
    from the rank of the same tp position; no stage needs to know the other's mesh.
    scale_grads=False: loss_fn already divides by the tokens, as train.py says."""
    stage = PipelineStage(model, mesh["pp"].get_local_rank(), mesh["pp"].size(), device,
                          group=mesh["pp"].get_group())
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return kind(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def clip_whole_model(parameters, max_norm, pp_group):
    """clip_grad_norm_ by the whole model's norm. get_total_norm of DTensor gradients already
    covers every dp and tp shard of this stage; each stage has only its own layers, so the
    stages' squared norms are summed over the pipeline (clip_grad_norm_ alone would clip each
    stage by its own norm: a different step). Returns the norm, before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if isinstance(norm, DTensor):  # summed over this stage's dp x tp shards already: its value
        norm = norm.full_tensor()
    squared = norm ** 2
    dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def bytes_held(model, optimizer):
    """What this rank holds, in bytes: its pieces of the weights, of their gradients (from the
    last step) and of Adam's two running averages (of a sharded tensor, a DTensor, its shard)."""
    def local_bytes(tensors):
        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {"weights": local_bytes(model.parameters()),
            "gradients": local_bytes(p.grad for p in model.parameters()),
            "optimizer": local_bytes(state)}


def bytes_per_rank(model, optimizer):
    """Every rank's bytes_held, in rank order, on every rank: a collective, all take part."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, bytes_held(model, optimizer))
    return every
