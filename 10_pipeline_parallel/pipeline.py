"""Lesson 10's idea: pipeline parallelism, the model's layers dealt out whole to the ranks of a
pipeline, each batch passed through them in micro-batches.

build_groups makes the pipelines and the dp groups across them; split_model keeps this rank's
stages (one, or two); afab_step runs one step of the simplest schedule by hand, build_schedule
the library's (zero-bubble ones too: split_backward.py); pad_batch fills a short batch;
average_gradients averages the pipelines' gradients; whole_model gathers every rank's layers.
"""

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

# The library's schedules; "afab" is this lesson's own (afab_step). The last three split each
# backward into B, the input's gradient, which the stage before waits for, and W, the weights'
# gradient, which nothing waits for: it fills the bubble (Qi et al., "Zero Bubble Pipeline
# Parallelism", ICLR 2024; DualPipeV: DeepSeek-V3's DualPipe, cut in half).
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zb1p": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
IGNORE = -100  # the target of a padding row: cross_entropy's ignore_index leaves it out


def stages_of_rank(schedule, rank, p):
    """The stages that rank holds in a pipeline of p ranks: stage rank; or two, each half as
    deep, rank and rank + p (interleaved: a loop) or rank and 2p - 1 - rank (zbv, dualpipev: a V,
    so that a micro-batch comes back down the ranks it went up, and rank 0 holds the loss)."""
    if schedule in ("zbv", "dualpipev"):
        return [rank, 2 * p - 1 - rank]
    return [rank, rank + p] if schedule == "interleaved" else [rank]


def build_groups(dp, p, timeout):
    """Rank r is stage r % p of pipeline r // p. With --dp 2 --stages 2: pipelines [0, 1] and
    [2, 3] (send and recv run along them), dp groups [0, 2] and [1, 3] (the ranks that hold the
    same layers, whose gradients are averaged). Every rank makes every group, each its own."""
    ranks = torch.arange(dp * p).view(dp, p)
    timeout = datetime.timedelta(seconds=timeout)  # not torch's default: gloo's is 30 minutes
    pp_group, _ = dist.new_subgroups_by_enumeration(ranks.tolist(), timeout=timeout)
    dp_group, _ = dist.new_subgroups_by_enumeration(ranks.T.tolist(), timeout=timeout)
    return pp_group, dp_group


def layer_names(model):
    """The linear layers in the order the data goes through them: fc1, hidden.0, ..., fc2."""
    return ["fc1", *(f"hidden.{i}" for i in range(len(model.hidden))), "fc2"]


def layers_per_stage(model, num_stages):
    """The names of each stage's linear layers, dealt out in equal consecutive runs: with
    --layers 3 (4 linear layers) and 2 stages, [["fc1", "hidden.0"], ["hidden.1", "fc2"]]."""
    names = layer_names(model)
    per_stage = len(names) // num_stages
    return [names[s * per_stage:(s + 1) * per_stage] for s in range(num_stages)]


class Stage(nn.Module):
    """Consecutive linear layers of the model, each followed by its ReLU, but for fc2's."""

    def __init__(self, layers, index, num_stages):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.index = index  # the stage's place in the pipeline: 0 reads the features
        self.last = index == num_stages - 1  # it ends with fc2's logits: no ReLU after them

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if not (self.last and i == len(self.layers) - 1):
                x = F.relu(x)
        return x


def split_model(model, schedule, pp_rank, p):
    """This rank's stages, as Stage modules; the model keeps only their layers.

    The layers of other ranks' stages become None, so the model's state dict holds this rank's
    layers under the names of the whole model (fc1.weight, ...): the checkpoint's pieces fit
    together by name."""
    placed = [stages_of_rank(schedule, r, p) for r in range(p)]
    num_stages = p * len(placed[0])
    plan = layers_per_stage(model, num_stages)
    if dist.get_rank() == 0:  # which layers each stage holds, and on which rank
        print("layers: " + " | ".join(f"stage {s} on rank {r}: " + " ".join(plan[s])
                                      for s, r in sorted((s, r) for r in range(p)
                                                         for s in placed[r])), flush=True)
    stages = [Stage([model.get_submodule(n) for n in plan[s]], s, num_stages)
              for s in placed[pp_rank]]
    mine = {n for s in placed[pp_rank] for n in plan[s]}
    for name in layer_names(model):
        if name not in mine:  # another rank's layer: drop it (nn.Module lets a child be None)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, None)
    return stages


# ---------------------------------------------------------------------------------------------
# The pipeline: by hand, then the library
# ---------------------------------------------------------------------------------------------
def afab_step(stage, features, targets, microbatches, loss_fn, pp_group):
    """One step of the simplest schedule, All Forwards then All Backwards (GPipe's order), by
    hand: stage s receives each micro-batch's activations from stage s - 1 and sends its own
    to stage s + 1; in backward, the gradients go the other way. Returns the last stage's
    micro-batch losses (none elsewhere)."""
    s, p = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    inputs, outputs, losses = [], [], []
    for x, y in zip(features.chunk(microbatches), targets.chunk(microbatches), strict=True):
        if s > 0:  # the previous stage's output, the same shape for every micro-batch
            x = torch.empty(len(x), stage.layers[0].in_features, device=features.device)
            dist.recv(x, group=pp_group, group_src=s - 1)
            x.requires_grad_()  # its gradient is what this stage sends back
        out = stage(x)
        if s < p - 1:
            dist.send(out.detach(), group=pp_group, group_dst=s + 1)
        else:
            out = loss_fn(out, y)  # only the last stage has the logits, so only it has a loss
            losses.append(out.detach())
        inputs.append(x)
        outputs.append(out)  # kept, with its graph, until its backward: m micro-batches held
    for x, out in zip(inputs, outputs, strict=True):
        if s < p - 1:  # the gradient of this stage's output, computed by the next stage
            grad = torch.empty_like(out)
            dist.recv(grad, group=pp_group, group_src=s + 1)
            out.backward(grad)
        else:
            out.backward()
        if s > 0:
            dist.send(x.grad, group=pp_group, group_dst=s - 1)
    return losses


def build_schedule(name, stages, microbatches, loss_fn, pp_group):
    """The library's schedule over this rank's stages, each in a PipelineStage (None: afab)."""
    if name == "afab":
        return None
    device = stages[0].layers[0].weight.device
    num_stages = dist.get_world_size(pp_group) * len(stages)
    pipeline_stages = [PipelineStage(stage, stage.index, num_stages, device, group=pp_group)
                       for stage in stages]
    # scale_grads=False: loss_fn already divides by the real rows of the whole batch, so the
    # micro-batches' gradients add up to the batch's mean (the library's default, True, divides
    # each micro-batch's by --microbatches: right only if every micro-batch is full).
    one = name in ("gpipe", "1f1b")  # these take one stage; the others a list of the rank's
    return SCHEDULES[name](pipeline_stages[0] if one else pipeline_stages,
                           n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def pad_batch(features, labels, batch_size):
    """Fill a short batch (the last of an epoch) to batch_size with rows whose target is IGNORE.

    The library fixes the micro-batches' shapes at its first step, and a smaller batch would
    stop the last stage ("Expected input batch_size (16) to match target batch_size (7)")."""
    short = batch_size - len(labels)
    features = torch.cat([features, features.new_zeros(short, features.shape[1])])
    return features, torch.cat([labels, labels.new_full((short,), IGNORE)])


def average_gradients(stages, dp_group):
    """Across pipelines: each layer's gradient averaged with its copies (lesson 08's all-reduce)."""
    for stage in stages:
        for param in stage.parameters():
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=dp_group)


def whole_model(model, whole):
    """Every rank's layers, gathered onto every rank into whole, a model of the same class."""
    mine = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)  # a collective: every rank takes part
    # strict: a layer that no rank held would stop here, not make a half-trained final.pt
    whole.load_state_dict({name: t for piece in pieces for name, t in piece.items()})
    return whole
