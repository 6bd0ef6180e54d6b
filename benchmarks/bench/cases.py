"""The measured cases, built on a rank: the models, DDP and the strategies of lessons 07 to 10
around them, the training step every case runs, and what each rank holds in memory.

Lessons 08, 09 and 10 are imported, not copied: lesson08(), lesson09() and lesson10() load
their files as their tests do."""

import argparse
import copy
import functools
import importlib.util
import io
import sys
import warnings
from contextlib import nullcontext, redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.flags import HIDDEN, LESSON08, LESSON09, LESSON10, TENSOR_PARALLEL, TP_2D

# Cases whose ranks never communicate while timed: each rank trains a model of its own.
ALONE = ("plain", "single-process-all-cores", "ceiling")
# "pipeline": a schedule on p ranks; "one-process": the whole model on one rank, its micro-batches
# one after another (the lesson's afab step on 1 stage): what p stages are compared with.
PIPELINE_CASES = ("pipeline", "one-process")
# FSDP warns, once per rank, that a layer split by TP "returned a view tensor" (TP's output, as a
# plain tensor, is a view of the DTensor's), which an in-place op could break: the 2d case's MLP
# makes none. The lessons' guard_rails.py silences it alike (tools/repro_tp_fsdp_warnings.py).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view")


def lesson_folder_first(folder):
    """Put a lesson's folder first on sys.path, where its train.py finds guard_rails.py,
    model.py, data.py and its own modules, and forget the modules of those names that another
    lesson's files left: each lesson has its own guard_rails.py (tests/helpers.py does alike)."""
    for path in folder.glob("*.py"):
        module = sys.modules.get(path.stem)
        if module is not None and Path(getattr(module, "__file__", None) or "").parent != folder:
            del sys.modules[path.stem]
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))


@functools.cache
def lesson08():
    """Lesson 08's train.py as a module, imported as its tests import it."""
    lesson_folder_first(LESSON08)
    spec = importlib.util.spec_from_file_location("lesson08_train", LESSON08 / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def lesson09():
    """Lesson 09's train.py as a module, imported as its tests import it: build_mesh (from its
    mesh.py) and split_model (from its tensor_parallel.py)."""
    lesson_folder_first(LESSON09)
    spec = importlib.util.spec_from_file_location("lesson09_train", LESSON09 / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def lesson10(name="measure_bubble"):
    """A file of lesson 10 as a module: measure_bubble.py (with MeasuredTrainer, and the
    train.py it imports as .train), or timeline.py (its bubble's instrument, with
    bubble_report), imported with the lesson's folder first on sys.path, where they find
    train.py, timeline.py and the lesson's own guard_rails.py."""
    lesson_folder_first(LESSON10)
    spec = importlib.util.spec_from_file_location(f"lesson10_{name}", LESSON10 / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_batch(model_name, batch, image_size, device, seed):
    """One fixed batch of random inputs, reused every step.

    Throughput does not depend on the values, and a fixed batch keeps data loading out of the
    measurement: what is timed is the model, the optimizer and DDP's communication."""
    generator = torch.Generator().manual_seed(seed)
    if model_name == "wine-mlp":
        features = torch.randn(batch, 13, generator=generator)  # 13 measurements per wine
        labels = torch.randint(0, 3, (batch,), generator=generator)
    else:
        features = torch.randn(batch, 3, image_size, image_size, generator=generator)
        labels = torch.randint(0, 10, (batch,), generator=generator)
    return features.to(device), labels.to(device)


@functools.cache  # built once per process; build_model hands out copies
def initial_model(model_name):
    torch.manual_seed(0)  # the same initial weights on every rank
    if model_name == "wine-mlp":
        # Lesson 01's 13 -> 64 -> 3, as lesson 08 defines it: its empty `hidden` list (no layers
        # between fc1 and fc2) is what lesson 09's split_model reads.
        return lesson08().WineMLP()
    # Imported here, not at the top: a run without ResNet-18 need not pay for torchvision's
    # import (with it, start_ranks has the server import it once, for every rank).
    from torchvision.models import resnet18

    return resnet18(num_classes=10)  # 11.2 M parameters, 44.7 MB of fp32 gradients a step


def build_model(model_name):
    """A fresh model with the same initial weights in every case and on every rank: a copy,
    since initialising ResNet-18's 11.2 M weights takes five times as long as copying them."""
    return copy.deepcopy(initial_model(model_name))


def autocast(case, device):
    """The forward pass's precision: bf16 autocast, or plain fp32 (no context at all).

    As the AMP docs teach it: forward and loss under torch.autocast, backward outside it (its
    ops run in the dtypes the forward chose); bf16 has float32's range, so no GradScaler."""
    if case["precision"] == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


class AutocastForward(nn.Module):
    """Runs the wrapped model's forward under bf16 autocast in whichever thread calls it.

    Autocast's state, its dtype included, is thread-local, and nn.DataParallel runs each replica
    in a thread of its own, where it re-enters autocast with enabled=True but no dtype (torch
    2.14, nn/parallel/parallel_apply.py): the replicas would run CUDA's default float16, not
    bf16. The AMP docs' rule for DataParallel ("Working with Multiple GPUs"): autocast inside
    the model's forward."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self.module(x)


def prepare(model, features, case, device):
    """The model and the input batch in the case's memory format, before any wrapper sees them.

    channels_last stores images as N,H,W,C, the layout the GPU's tensor-core convolutions work
    in, so cuDNN need not transpose each activation. As PyTorch's channels_last tutorial shows,
    both the model (its 4-D conv weights) and the input are converted; DDP accepts channels_last
    parameters as long as every rank's have the same strides (its docstring), which they do:
    every rank converts the same model here, before DDP broadcasts and buckets it."""
    model = model.to(device)
    if case["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
        features = features.contiguous(memory_format=torch.channels_last)
    return model, features


def wrap_model(model, case, device, group=None):
    """The model as the case runs it: plain, DDP with the case's knob, or DataParallel.

    group: the process group DDP all-reduces over; None for every rank of the launch, a smaller
    group for a case with fewer ranks than the launch has (the per-worker cases on the CPU). For
    tp and 2d, the case's dp x tp device mesh (lesson 09's build_mesh)."""
    if case["case"] == "dataparallel":
        # One process drives every GPU: it copies the model to each GPU at every forward pass
        # and gathers the outputs on the first; the classic comparison with DDP.
        if case["precision"] == "bf16":
            model = AutocastForward(model)
        return nn.DataParallel(model, device_ids=list(range(case["world_size"])))
    if case["case"] in ALONE:
        return model
    if case["case"] == "fsdp":
        return shard_fully(model, case, device)
    if case["case"] in TENSOR_PARALLEL:
        return lesson09().split_model(model, group)
    knob, value = case["knob"], case["knob_value"]
    options = {}
    if knob == "bucket_cap_mb":
        options["bucket_cap_mb"] = float(value)  # gradients per all-reduce (default 25 MB)
    elif knob == "gradient_as_bucket_view":
        options["gradient_as_bucket_view"] = True  # grads live in the buckets: no copy
    elif knob == "static_graph":
        options["static_graph"] = True  # the same parameters are used every step
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    process_group=group, **options)
    if knob in ("fp16_hook", "bf16_hook"):
        # Compress each gradient bucket to 16 bits before the all-reduce and back after it:
        # half the bytes on the wire, a little precision lost.
        hook = (default_hooks.fp16_compress_hook if knob == "fp16_hook"
                else default_hooks.bf16_compress_hook)
        ddp_model.register_comm_hook(state=None, hook=hook)
    return ddp_model


def shard_fully(model, case, device):
    """FSDP2 as lesson 07 applies it: fully_shard on each unit, then on the root.

    The units are the wine MLP's two layers and ResNet-18's eight residual blocks (the root
    takes the stem convolution, its batch norm and the classifier). The mesh is given
    explicitly on the rank's device type, as in lesson 07: fully_shard's default mesh would move
    a CPU (gloo) model to a GPU whenever one exists."""
    # From the process group itself: init_device_mesh would make a new group, with the 30-minute
    # default timeout instead of --timeout, for a gloo group on a machine with CUDA.
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    if case["model"] == "wine-mlp":
        units = [model.fc1, model.fc2]
    else:
        units = [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                 for block in layer]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def tensor_layout(case, world_size):
    """(dp, tp) of lesson 09's layout: tp, one TP group of every rank; 2d, TP groups of TP_2D."""
    tp = world_size if case == "tp" else TP_2D
    return world_size // tp, tp


def build_optimizer(model, case):
    """SGD with momentum: one state tensor (the momentum buffer) per parameter. For zero1 each
    rank keeps it for its share of the parameters only (ZeroRedundancyOptimizer, ZeRO stage 1);
    under FSDP the plain optimizer already sees only this rank's shards."""
    if case["case"] == "zero1":
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                       lr=0.01, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def make_step(model, optimizer, batch, case, device, finish=None):
    """One training step. Every case, plain model, DDP, ZeRO-1, FSDP and DataParallel alike,
    runs this same step with the same synchronisation points, so a difference between them is
    the wrapper's, not the loop's.
    With accumulate > 1, gradients of `accumulate` micro-batches add up before one optimizer
    step, and DDP's no_sync skips the all-reduce on all but the last of them. finish, for
    lesson 08's modes, completes the gradient synchronisation before the update."""
    features, labels = batch
    accumulate = case["accumulate"]

    def step():
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            skip_sync = micro < accumulate - 1
            with model.no_sync() if skip_sync else nullcontext():
                with autocast(case, device):
                    loss = F.cross_entropy(model(features), labels)
                loss.backward()
        if finish:
            finish()
        optimizer.step()

    return step


def build_training_case(case, device, group):
    """A training case, built once per launch and warmed up. group: as wrap_model's.

    Returns (work, held): work() runs one repeat, the case's `steps` timed forward/backward
    passes; held is memory_held's figures for this rank."""
    devices = case["world_size"] if case["case"] == "dataparallel" else 1
    allocated_before = 0
    if device.type == "cuda":
        allocated_before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    # Every rank its own batch, but the ranks of one TP group the same one (its dp row's): they
    # compute one model's step together, as lesson 09's sampler deals batches over "dp" only.
    seed = group["dp"].get_local_rank() if case["case"] in TENSOR_PARALLEL else dist.get_rank()
    features, labels = make_batch(case["model"], case["batch_per_rank"] * devices,
                                  case["image_size"], device, seed=seed)
    model, features = prepare(build_model(case["model"]), features, case, device)
    finish = None
    if case["case"] == "lesson08":
        # DDP's default bucket size, 25 MiB, for the modes that use buckets (buckets, ddp).
        model, finish = lesson08().make_grad_sync(model, case["knob_value"], 25)
    else:
        model = wrap_model(model, case, device, group)
    optimizer = build_optimizer(model, case)
    step = make_step(model, optimizer, (features, labels), case, device, finish)
    # The first steps are slow (memory allocation, DDP's first-step bookkeeping, CUDA kernel
    # selection) and would make the first repeat look slower than the others: leave them out.
    for _ in range(case["warmup"]):
        step()
    synchronize(device, devices)

    def work():
        for _ in range(case["steps"] // case["accumulate"]):
            step()
        synchronize(device, devices)

    return work, memory_held(model, optimizer, device, allocated_before)


def build_pipeline_case(case, device, group, rank):
    """A pipeline case, built and warmed up with lesson 10's own pieces: its WineMLP(hidden,
    layers) from the same seed on every rank, split_model (this rank's stage; interleaved: two),
    Adam, and its Trainer, whose train_step runs one step of the schedule (afab by hand, the
    others torch's); with simulate_ms, measure_bubble.py's MeasuredTrainer, whose layers sleep
    (F simulate_ms, B and W simulate_ms each: 2 x simulate_ms backward) and record every
    forward and backward. group: the case's ranks (None: every rank of the launch).

    Returns (work, record): work() runs one repeat, the case's `steps` steps on one fixed batch,
    the same on every stage (the first reads its features, the last its labels); record holds
    the trainer's timeline (a list of events per step) and where each call of work() began in
    it, for pipeline_bubbles."""
    bubble = lesson10("measure_bubble")
    train = bubble.train  # the train.py that MeasuredTrainer extends
    group = group or dist.group.WORLD
    p = case["stages"]
    # The lesson's own flags, parsed by its parse_args (with simulate_ms, measure_bubble's: B
    # and W default to F): every setting its Trainer reads, with the lesson's defaults (its --lr
    # for Adam) for those the case does not set.
    flags = ["--schedule", case["schedule"], "--stages", str(p), "--dp", "1",
             "--microbatches", str(case["microbatches"]),
             "--batch-size", str(case["global_batch"]), "--layers", str(case["layers"]),
             "--hidden", str(HIDDEN)]
    simulated = case["simulate_ms"] is not None
    settings = (bubble.parse_args([*flags, "--simulate-ms", str(case["simulate_ms"])])
                if simulated else train.parse_args(flags))
    settings.dp = 1  # one pipeline: no gradients to average across pipelines
    torch.manual_seed(0)  # the same initial weights on every rank; each keeps its own layers
    model = train.WineMLP(hidden=HIDDEN, layers=case["layers"]).to(device)
    with redirect_stdout(io.StringIO()):  # its "layers: ..." line, once per case
        stages = train.split_model(model, case["schedule"], dist.get_rank(group), p)
    assert len(stages) == case["chunks"], (case, len(stages))
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    # The Trainer makes its pipeline's groups with build_groups, over every rank of the launch;
    # here only the case's ranks build it (the one process: rank 0), so it gets the case's group,
    # made by every rank (make_groups), as new_group requires.
    plain, train.build_groups = train.build_groups, lambda *_: (group, None)
    try:
        trainer = (bubble.MeasuredTrainer if simulated else train.Trainer)(
            model, None, None, optimizer, device, settings.save_every, settings.out_dir, stages,
            settings)
    finally:
        train.build_groups = plain
    features, labels = make_batch("wine-mlp", case["global_batch"], None, device, seed=0)
    # The first step also sets the pipeline up (torch's stages exchange their shapes).
    for _ in range(case["warmup"]):
        trainer.train_step(features, labels)
    synchronize(device)
    # MeasuredTrainer's timeline: every step's events (none without the simulation).
    record = {"timeline": getattr(trainer, "timeline", []), "starts": []}

    def work():
        record["starts"].append(len(record["timeline"]))
        for _ in range(case["steps"]):
            trainer.train_step(features, labels)
        synchronize(device)

    return work, record


def pipeline_bubbles(case, record, repeats):
    """The bubble of each measured repeat (the last `repeats` calls of work()): lesson 10's
    bubble_report over the repeat's steps, from every stage's timeline, the median of their
    bubbles (1 - busy time of the p ranks / (p x the step's wall time)). A collective: every
    rank of the launch calls it, in the same order; a rank outside the case passes None."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    timelines = [mine["timeline"] for mine in everyone[:case["world_size"]]]
    ms = case["simulate_ms"]  # F, and B and W alike, as measure_bubble.py's defaults
    settings = argparse.Namespace(stages=case["stages"], schedule=case["schedule"],
                                  microbatches=case["microbatches"], simulate_ms=ms,
                                  backward_ms=ms, weight_ms=ms)
    # bubble_report leaves out the first step it is given (the lesson's step 0, which sets the
    # pipeline up): here, the step before the repeat, so every step of the repeat counts.
    report = lesson10("timeline").bubble_report
    return [report([t[start - 1:start + case["steps"]] for t in timelines], settings)["measured"]
            for start in everyone[0]["starts"][-repeats:]]


def build_allreduce_case(case, device, groups):
    """All-reduces of one message size, timed the way nccl-tests does; work() runs `iters`."""
    group = groups[case["backend"]]
    tensor_device = device if case["device"] == "cuda" else torch.device("cpu")
    tensor = torch.zeros(case["size_bytes"] // 4, dtype=torch.float32, device=tensor_device)
    for _ in range(case["warmup"]):
        dist.all_reduce(tensor, group=group)
    synchronize(tensor_device)

    def work():
        for _ in range(case["iters"]):
            dist.all_reduce(tensor, group=group)
        synchronize(tensor_device)

    return work, None


def synchronize(device, devices=1):
    # CUDA runs asynchronously: without waiting for the GPU, the clock would stop while the
    # work is still queued. DataParallel keeps several GPUs busy, so wait for each of them.
    if device.type == "cuda":
        for index in range(devices):
            torch.cuda.synchronize(index if devices > 1 else device)


def make_cublas_workspaces(device):
    """Let cuBLAS take its workspaces now, before any case's memory is counted.

    cuBLAS takes a workspace for each thread that multiplies, from the allocator that tensors
    use, and keeps it (torch's own leak check clears them before it counts:
    torch/testing/_internal/common_utils.py): megabytes that would land in the peak of
    whichever case multiplied first. One forward and backward of a throwaway model makes both:
    this thread's for forward, and that of autograd's own thread for this GPU, for backward."""
    build_model("wine-mlp").to(device)(torch.zeros(2, 13, device=device)).sum().backward()


def local_bytes(tensors):
    """Bytes of the tensors as this rank holds them: of a sharded tensor (a DTensor), only the
    shard that lives here, as lesson 07 counts them."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_held(model, optimizer, device, allocated_before):
    """[parameters, gradients, optimizer state, peak] in bytes, as this rank holds them.

    Peak is torch.cuda.max_memory_allocated during the case's build and warm-up steps, less what
    was allocated before the case began (the cases built before it, which stay alive for the
    rounds): the case's own peak. GPUs only: on the CPU the process's peak resident memory
    covers every case of the process, so it is left out (-1 here, null in the rows)."""
    params = list(model.parameters())
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    peak = (torch.cuda.max_memory_allocated(device) - allocated_before
            if device.type == "cuda" else -1)
    return [local_bytes(params), local_bytes(p.grad for p in params), local_bytes(state), peak]


def largest_over_ranks(held, case, device):
    """memory_held's figures, the largest over the ranks: the rank that needs the most memory
    decides what fits. A rank that sits the case out gives zeros."""
    row = torch.tensor(held, dtype=torch.int64, device=device)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)
    held = row.tolist()
    if case["case"] == "dataparallel":
        # DataParallel's replicas on the other GPUs exist only during forward and backward, and
        # its gradients are summed on GPU 0: GPU 0's figures would not describe the others.
        return [None] * 4
    return held[:3] + [held[3] if held[3] >= 0 else None]
