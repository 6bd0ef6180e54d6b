"""Benchmark: what DDP buys on the hardware at hand, side by side with the alternatives.

Lesson 02's set-up (start_ranks, one process group, threads split between ranks, gloo on the CPU,
NCCL with one GPU per rank), used to measure instead of to train. For each world size 1..N it
trains two models for a fixed number of steps, warm-up excluded, and reports samples per second:
the lesson's 13->64->3 wine MLP (which will not speed up) and a torchvision ResNet-18 on random
images (which can). Beside them: the plain model without DDP (DDP's own cost at world size 1),
on the CPU one process using every core (the honest answer on a laptop), every rank with the
same few threads (how DDP scales when each rank brings its own cores) and, as its ceiling, as many
independent plain processes at once (what N workers reach with no communication at all); on GPUs
nn.DataParallel on the same 2..N GPUs; the DDP knobs that matter, and the all-reduce bandwidth of
the backend. Next to DDP, lesson 07's sharded strategies at every world size: ZeRO-1 (DDP with
ZeroRedundancyOptimizer) and FSDP2 (fully_shard), with the bytes of parameters, gradients and
optimizer state each rank holds, and on GPUs each rank's peak memory; and lesson 09's layouts of
the wine MLP: tensor parallelism (tp, fc1 column-wise and fc2 row-wise over all the ranks) and
2-D (dp x tp, FSDP over "dp" of TP groups of 2), whose TP ranks read the same batch. With
--pipeline, lesson 10's schedules (afab, gpipe, 1f1b, interleaved) on its deeper wine MLP, one
stage per rank: the bubble, measured with --simulate-ms (each layer sleeps, so a stage's compute
is known), and the samples/s with and without it, against one process running the same
micro-batches in turn.
On GPUs ResNet-18 runs as it is trained there: 224x224 images, batch 256 per GPU, bf16 autocast,
channels_last. Nothing is downloaded.

Every figure is the median of --repeats measurements (5; 3 with --quick), printed with its
spread (min-max). Starting a world size's processes costs seconds (each imports torch), so each
world size is one launch: its processes build and warm up every case once, run one untimed
round of them, then measure them in rounds, one repeat of every case per round (round robin), so
that a machine that slows down for a while slows every case alike instead of one case's repeats.
What is interleaved with what: the cases of one launch with each other; on the CPU the
per-worker cases of every world size (DDP and the independent processes, 1..N) all run in the
N-rank launch, ranks beyond a case's world size waiting, so that the per-worker efficiency
compares measurements taken side by side. Cases of different launches (the all-cores cases of
world size 1 against DDP on N ranks) are not interleaved. A noise check measures one case in the
last launch before its rounds and again after them: if the two medians differ by more than 5%,
the machine was too busy for the figures, and the run says so.

Run it:
    python benchmarks/scaling.py --quick                  # about 3 minutes on a 2-core laptop
    python benchmarks/scaling.py                          # the full default, minutes
    python benchmarks/scaling.py --models resnet18 --max-world-size 4
    python benchmarks/scaling.py --models wine-mlp --max-world-size 4   # tp on 2 and 4, 2d on 4
    python benchmarks/scaling.py --device cpu             # the CPU cases, even on a GPU node
    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/scaling.py # NCCL DDP and DataParallel, 1-2 GPUs
    python benchmarks/scaling.py --models resnet18 --knobs none --sharded none \
        --grad-sync after-backward,flat,overlap,buckets,ddp   # lesson 08's modes beside DDP
    python benchmarks/scaling.py --models wine-mlp --max-world-size 4 --knobs none \
        --sharded none --tensor-parallel none --pipeline afab,gpipe,1f1b,interleaved

It writes results.json and results.csv (one row per training case), allreduce.json and
allreduce.csv (one row per message size), pipeline.json and pipeline.csv (one row per pipeline
case), run.json (machine, command, load, noise check) and scaling.png into --out-dir.
"""

import argparse
import copy
import csv
import datetime
import functools
import gc
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

MODELS = ("wine-mlp", "resnet18")
KNOBS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "fp16_hook", "bf16_hook",
         "no_sync")
ROW_FIELDS = ("model", "case", "knob", "knob_value", "world_size", "processes", "backend",
              "device", "threads_per_rank", "batch_per_rank", "global_batch", "image_size",
              "precision", "channels_last", "accumulate", "steps", "warmup", "repeats",
              "seconds", "samples_per_s", "samples_per_s_min", "samples_per_s_max", "speedup",
              "efficiency", "efficiency_vs_ceiling", "vs_default", "ddp_cost_pct",
              "parameter_bytes", "gradient_bytes", "optimizer_bytes", "peak_bytes",
              "repeat_samples_per_s", "repeat_order")
# Lesson 07's strategies, measured next to DDP at every world size.
SHARDED = ("zero1", "fsdp")
# Lesson 09's layouts of the wine MLP, made by its own build_mesh and split_model
# (09_tensor_parallel/tensor_parallel.py): tp, every rank of the world size in one TP group; 2d,
# dp x tp with TP groups of TP_2D ranks and FSDP across them. ResNet-18 has none: the plan
# splits Linear layers, not convolutions.
LESSON09 = Path(__file__).resolve().parent.parent / "09_tensor_parallel"
TENSOR_PARALLEL = ("tp", "2d")
TP_2D = 2
HIDDEN = 64  # the wine MLP's hidden units: fc1's output columns, dealt out over the TP ranks
BANDWIDTH_FIELDS = ("backend", "device", "world_size", "size_bytes", "iters", "repeats",
                    "seconds_per_op", "seconds_per_op_min", "seconds_per_op_max", "algbw_GBps",
                    "busbw_GBps", "repeat_order")
# Lesson 08's hand-written gradient synchronisations (and DDP through the same function),
# measured with --grad-sync; its make_grad_sync(model, mode, bucket_mb) returns the model to call
# and finish(), to call between loss.backward() and optimizer.step().
LESSON08 = Path(__file__).resolve().parent.parent / "08_ddp_from_scratch"
GRAD_SYNC = ("after-backward", "flat", "overlap", "buckets", "ddp")
# Lesson 10's schedules, measured with --pipeline: its own Trainer.train_step on its deeper wine
# MLP (WineMLP(hidden, layers)), split by its split_model, one stage per rank (interleaved: two).
LESSON10 = Path(__file__).resolve().parent.parent / "10_pipeline_parallel"
PIPELINE = ("afab", "gpipe", "1f1b", "interleaved")
# "pipeline": a schedule on p ranks; "one-process": the whole model on one rank, its micro-batches
# one after another (the lesson's afab step on 1 stage): what p stages are compared with.
PIPELINE_CASES = ("pipeline", "one-process")
PIPELINE_FIELDS = ("model", "case", "schedule", "world_size", "stages", "chunks", "processes",
                   "backend", "device", "threads_per_rank", "layers", "microbatches",
                   "global_batch", "simulate_ms", "steps", "warmup", "repeats", "seconds",
                   "samples_per_s", "samples_per_s_min", "samples_per_s_max", "speedup",
                   "bubble_formula", "bubble", "bubble_min", "bubble_max", "ideal_speedup",
                   "repeat_samples_per_s", "repeat_bubble", "repeat_order")
# Cases whose ranks never communicate while timed: each rank trains a model of its own.
ALONE = ("plain", "single-process-all-cores", "ceiling")
# FSDP warns, once per rank, that a layer split by TP "returned a view tensor" (TP's output, as a
# plain tensor, is a view of the DTensor's), which an in-place op could break: the 2d case's MLP
# makes none. The lessons' guard_rails.py silences it alike (tools/repro_tp_fsdp_warnings.py).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view")
# Two medians of the same case, at the start and at the end of a run, further apart than this:
# the machine's speed changed during the run, and its figures compare unlike conditions.
NOISE_LIMIT_PCT = 5.0


# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------
def fail(message):
    """Stop with one line that says what is wrong and how to fix it (no traceback)."""
    sys.exit(f"error: {message}")


def cpu_cores():
    """The cores this process may run on (a container or taskset may allow fewer than exist)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def find_free_port():
    # Port 0 asks the operating system for any free port: one fresh port per world size, so a
    # group that is still closing cannot collide with the next one.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def setup_process_group(rank, world_size, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    if backend == "nccl":
        # One GPU per rank, chosen before anything touches CUDA (see lesson 02).
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    # The timeout bounds every collective: a rank whose peer died fails after it instead of
    # waiting forever.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def make_group(timeout, ranks=None, backend=None):
    """A process group beside the launch's, with its --timeout. Without one, new_group gives
    the 30-minute default, whatever init_process_group was given (torch 2.14,
    torch/distributed/distributed_c10d.py: _new_group_with_tag), and a collective that a peer
    never joins would hold the run that long. new_group's rule: every rank creates every
    group, in the same order."""
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout), backend=backend)


def leave_group(failed):
    """Leave the process group with the lessons' own guard_rails.leave_group: after a failure
    with NCCL it aborts the group, since destroying it would wait for collectives that no peer
    joins (its docstring says why); otherwise it destroys it."""
    lesson08()  # puts lesson 08's folder, where guard_rails.py is, on sys.path
    import guard_rails

    guard_rails.leave_group(failed)


def make_cublas_workspaces(device):
    """Let cuBLAS take its workspaces now, before any case's memory is counted.

    cuBLAS takes a workspace for each thread that multiplies, from the allocator that tensors
    use, and keeps it (torch's own leak check clears them before it counts:
    torch/testing/_internal/common_utils.py): megabytes that would land in the peak of
    whichever case multiplied first. One forward and backward of a throwaway model makes both:
    this thread's for forward, and that of autograd's own thread for this GPU, for backward."""
    WineMLP().to(device)(torch.zeros(2, 13, device=device)).sum().backward()


def synchronize(device, devices=1):
    # CUDA runs asynchronously: without waiting for the GPU, the clock would stop while the
    # work is still queued. DataParallel keeps several GPUs busy, so wait for each of them.
    if device.type == "cuda":
        for index in range(devices):
            torch.cuda.synchronize(index if devices > 1 else device)


def slowest(seconds, device):
    """The largest of the ranks' times: a step is only done when the slowest rank is done."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def load_average():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


# ---------------------------------------------------------------------------------------------
# Data and models
# ---------------------------------------------------------------------------------------------
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


class WineMLP(nn.Module):
    """Lesson 01's model: 13 measurements -> 64 hidden units -> 3 cultivars. Its empty `hidden`
    is lesson 09's list of the layers between fc1 and fc2 (none here), which its split_model
    reads."""

    def __init__(self, in_features=13, hidden=64, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.hidden = nn.ModuleList()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


@functools.cache  # built once per process; build_model hands out copies
def initial_model(model_name):
    torch.manual_seed(0)  # the same initial weights on every rank
    if model_name == "wine-mlp":
        return WineMLP()
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


# ---------------------------------------------------------------------------------------------
# The measured cases
# ---------------------------------------------------------------------------------------------
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


@functools.cache
def lesson08():
    """Lesson 08's train.py as a module, imported as its tests import it: with the lesson's
    folder on sys.path, where train.py finds guard_rails.py."""
    sys.path.insert(0, str(LESSON08))
    spec = importlib.util.spec_from_file_location("lesson08_train", LESSON08 / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def lesson09():
    """Lesson 09's tensor_parallel.py as a module: build_mesh and split_model (torch only)."""
    spec = importlib.util.spec_from_file_location("lesson09_tensor_parallel",
                                                  LESSON09 / "tensor_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def lesson10(name="train"):
    """A file of lesson 10 as a module: train.py, or timeline.py (its bubble's instrument,
    with bubble_report), imported with the lesson's folder on sys.path, where train.py finds
    timeline.py and guard_rails.py (byte-identical to lesson 08's)."""
    if str(LESSON10) not in sys.path:
        sys.path.insert(0, str(LESSON10))
    spec = importlib.util.spec_from_file_location(f"lesson10_{name}", LESSON10 / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_pipeline_case(case, device, group, rank):
    """A pipeline case, built and warmed up with lesson 10's own pieces: its WineMLP(hidden,
    layers) from the same seed on every rank, split_model (this rank's stage; interleaved: two),
    Adam, and its Trainer, whose train_step runs one step of the schedule (afab by hand, the
    others torch's), and with simulate_ms sleeps in each layer and records every forward and
    backward. group: the case's ranks (None: every rank of the launch).

    Returns (work, record): work() runs one repeat, the case's `steps` steps on one fixed batch,
    the same on every stage (the first reads its features, the last its labels); record holds
    the trainer's timeline (a list of events per step) and where each call of work() began in
    it, for pipeline_bubbles."""
    train = lesson10()
    group = group or dist.group.WORLD
    p, v = case["stages"], case["chunks"]
    stage_ids = [dist.get_rank(group) + c * p for c in range(v)]
    torch.manual_seed(0)  # the same initial weights on every rank; each keeps its own layers
    model = train.WineMLP(hidden=HIDDEN, layers=case["layers"]).to(device)
    stages = train.split_model(model, stage_ids, p * v)
    # The lesson's own flags, parsed by its parse_args: every setting its Trainer reads, with
    # the lesson's defaults (its --lr for Adam) for those the case does not set.
    simulate = [] if case["simulate_ms"] is None else ["--simulate-ms", str(case["simulate_ms"])]
    settings = train.parse_args(["--schedule", case["schedule"], "--stages", str(p),
                                 "--microbatches", str(case["microbatches"]),
                                 "--batch-size", str(case["global_batch"]),
                                 "--layers", str(case["layers"]), "--hidden", str(HIDDEN),
                                 *simulate])
    settings.dp = 1  # one pipeline: no gradients to average across pipelines
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    trainer = train.Trainer(model, stages, stage_ids, None, optimizer, device, settings, rank,
                            group, None)
    features, labels = make_batch("wine-mlp", case["global_batch"], None, device, seed=0)
    # The first step also sets the pipeline up (torch's stages exchange their shapes).
    for _ in range(case["warmup"]):
        trainer.train_step(features, labels)
    synchronize(device)
    record = {"timeline": trainer.timeline, "starts": []}

    def work():
        record["starts"].append(len(trainer.timeline))
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
    settings = argparse.Namespace(stages=case["stages"], schedule=case["schedule"],
                                  microbatches=case["microbatches"])
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


def timed(work, device):
    """Seconds of the slowest rank for one repeat, the clock started on every rank at once.

    A rank that sits the case out passes a work() that does nothing: it waits at the barrier
    and in slowest()'s all-reduce, blocked in gloo or NCCL, not computing.
    Python's garbage collector is off while the clock runs, as timeit turns it off: a full
    collection walks every Python object of the process (about 120 ms here) and would land in
    whichever repeat crossed its threshold. It collects between repeats instead."""
    gc.disable()
    try:
        dist.barrier()
        start = time.perf_counter()
        work()
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    return slowest(seconds, device)


def summarise(case, seconds, order, held, processes):
    """The case's row: the median of its repeats, with their spread (min and max).

    algbw = bytes / time per all-reduce. busbw = algbw * 2(n-1)/n: a ring all-reduce sends and
    receives 2(n-1)/n of the message per rank, so busbw is what each link carried, comparable
    across world sizes and with the hardware's link speed. With n = 1 nothing crosses a link."""
    if case["case"] == "allreduce":
        per_op = [s / case["iters"] for s in seconds]
        median, n = statistics.median(per_op), case["world_size"]
        algbw = case["size_bytes"] / median / 1e9
        row = {field: case.get(field) for field in BANDWIDTH_FIELDS}
        row.update(repeats=len(per_op), seconds_per_op=median, seconds_per_op_min=min(per_op),
                   seconds_per_op_max=max(per_op), algbw_GBps=algbw,
                   busbw_GBps=algbw * 2 * (n - 1) / n if n > 1 else None, repeat_order=order)
        return row
    rates = [case["global_batch"] * case["steps"] / s for s in seconds]
    row = {field: case.get(field) for field in ROW_FIELDS}
    row.update(processes=processes, repeats=len(rates), seconds=statistics.median(seconds),
               samples_per_s=statistics.median(rates), samples_per_s_min=min(rates),
               samples_per_s_max=max(rates), repeat_samples_per_s=rates, repeat_order=order,
               **dict(zip(("parameter_bytes", "gradient_bytes", "optimizer_bytes", "peak_bytes"),
                          held, strict=True)))
    if case.get("noise_check"):
        row["noise_check"] = case["noise_check"]  # main() takes it out of the rows
    return row


def summarise_pipeline(case, seconds, order, bubbles, processes):
    """A pipeline case's row: samples/s and (with simulate_ms) the bubble, each the median of
    the repeats with their spread, and the bubble's formula for the case's p, v and m."""
    rates = [case["global_batch"] * case["steps"] / s for s in seconds]
    row = {field: case.get(field) for field in PIPELINE_FIELDS}
    row.update(processes=processes, repeats=len(rates), seconds=statistics.median(seconds),
               samples_per_s=statistics.median(rates), samples_per_s_min=min(rates),
               samples_per_s_max=max(rates), repeat_samples_per_s=rates, repeat_order=order,
               bubble_formula=bubble_formula(case["stages"], case["chunks"],
                                             case["microbatches"]))
    if bubbles:
        row.update(bubble=statistics.median(bubbles), bubble_min=min(bubbles),
                   bubble_max=max(bubbles), repeat_bubble=bubbles)
    return row


def case_name(case):
    """'ddp', a knob as 'static_graph=True', lesson 08's mode as 'lesson08 buckets', or lesson
    09's layout with its mesh as '2d (dp 2 x tp 2)'."""
    if case["case"] in TENSOR_PARALLEL:
        dp, tp = tensor_layout(case["case"], case["world_size"])
        return f"{case['case']} (dp {dp} x tp {tp})"
    if case["knob"] is None:
        return case["case"]
    if case["case"] == "lesson08":
        return f"lesson08 {case['knob_value']}"
    return f"{case['knob']}={case['knob_value']}"


def describe(case):
    if case["case"] in PIPELINE_CASES:
        simulated = (f"simulated {case['simulate_ms']:g} ms/layer" if case["simulate_ms"]
                     is not None else "not simulated")
        where = (f"{case['schedule']} p={case['stages']} x v={case['chunks']}"
                 if case["case"] == "pipeline" else "one process")
        return (f"{case['model']} --layers {case['layers']} pipeline {where}, "
                f"{case['microbatches']} micro-batches, {simulated} ws={case['world_size']} "
                f"({case['threads_per_rank']} thread(s)/rank, batch {case['global_batch']})")
    if case["case"] == "allreduce":
        return (f"all-reduce {case['backend']} on {case['device']} ws={case['world_size']} "
                f"{format_bytes(case['size_bytes'])}")
    name = case_name(case)
    if case.get("noise_check"):
        name += {"start": " (noise check, before the rounds)",
                 "end": " (noise check, after the rounds)"}[case["noise_check"]]
    return (f"{case['model']} {name} ws={case['world_size']} "
            f"({case['threads_per_rank']} thread(s)/rank, batch {case['batch_per_rank']}/rank)")


def worker(rank, world_size, backend, cases, total, args, partial_path, port):
    """What start_ranks runs in each rank: build every case of this launch, run one untimed round of
    them, then measure them in rounds, one repeat of every case per round (the noise check's
    case all at once before the rounds and after them)."""
    failed = True  # until the last line of the work: then the group is destroyed, not aborted
    # Where to meet, set here: a rank forked from the server has the environment the server
    # started with, at the first world size, not the launcher's of this one.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        device = setup_process_group(rank, world_size, backend, args.timeout)
        if device.type == "cuda":
            # Let cuDNN time its convolution algorithms for these shapes once and keep the
            # fastest, as GPU training scripts do. It tunes during the warm-up steps, and every
            # case of this process, plain model and DDP alike, runs with it.
            torch.backends.cudnn.benchmark = True
            make_cublas_workspaces(device)
        # NCCL versus gloo on the same GPU tensors needs a second group; every rank creates it.
        groups = {backend: None}
        if backend == "nccl" and any(case.get("backend") == "gloo" for case in cases):
            groups["gloo"] = make_group(args.timeout, backend="gloo")
        # A DDP case with fewer ranks than this launch (per worker, on the CPU) all-reduces in a
        # group of its own ranks.
        smaller = sorted({c["world_size"] for c in cases if c["world_size"] < world_size
                          and c["case"] not in (*ALONE, "dataparallel", *TENSOR_PARALLEL)})
        subgroups = {size: make_group(args.timeout, list(range(size))) for size in smaller}
        # A tp or 2d case runs on its dp x tp mesh, one per layout, made by every rank.
        meshes = {}
        for case in cases:
            if case["case"] in TENSOR_PARALLEL:
                layout = tensor_layout(case["case"], case["world_size"])
                if layout not in meshes:
                    meshes[layout] = lesson09().build_mesh(*layout, device, args.timeout)
        works, held, records = [], [], {}
        for index, case in enumerate(cases):
            torch.set_num_threads(case["threads_per_rank"])
            if case["case"] in PIPELINE_CASES:
                # No memory figures, so no collective here for a rank outside the case.
                work, records[index] = (lambda: None), None
                if rank < case["world_size"]:
                    work, records[index] = build_pipeline_case(
                        case, device, subgroups.get(case["world_size"]), rank)
                works.append(work)
                held.append(None)
                continue
            if rank >= case["world_size"]:
                work, mine = (lambda: None), [0, 0, 0, -1]  # not one of this case's ranks
            elif case["case"] == "allreduce":
                work, mine = build_allreduce_case(case, device, groups)
            elif case["case"] in TENSOR_PARALLEL:
                mesh = meshes[tensor_layout(case["case"], case["world_size"])]
                work, mine = build_training_case(case, device, mesh)
            else:
                work, mine = build_training_case(case, device, subgroups.get(case["world_size"]))
            works.append(work)
            held.append(None if mine is None else largest_over_ranks(mine, case, device))
        # What the builds left behind (every case's model, wrapper and optimizer: hundreds of
        # thousands of Python objects with torch's own) is collected now, outside any timing,
        # and frozen (gc.freeze): later collections skip it.
        gc.collect()
        gc.freeze()
        seconds, order = [[] for _ in cases], [[] for _ in cases]
        position, start = 0, time.monotonic()

        def run(index):
            torch.set_num_threads(cases[index]["threads_per_rank"])
            return timed(works[index], device)

        def measure(index):
            nonlocal position
            seconds[index].append(run(index))
            order[index].append(position)
            position += 1

        # One untimed round first, every case once: right after the builds, the first seconds of
        # measurement ran slow on a 2-core machine, whatever the case (benchmarks/README.md);
        # the round lets the processes settle.
        for index in range(len(cases)):
            run(index)
        # The noise check's case, if this launch has it: all its repeats before the rounds,
        # and all those of its copy after them.
        checks = {when: [i for i, c in enumerate(cases) if c.get("noise_check") == when]
                  for when in ("start", "end")}
        for index in checks["start"]:
            for _ in range(args.repeats):
                measure(index)
        # Round robin: one repeat of every case per round. Every case lives through all the
        # rounds (on a GPU: its input batch, weights, gradients and optimizer state; the
        # activations of a step are freed by its backward pass).
        for repeat in range(args.repeats):
            for index, case in enumerate(cases):
                if not case.get("noise_check"):
                    measure(index)
            if rank == 0:
                print(f"world size {world_size}: round {repeat + 1}/{args.repeats} done, "
                      f"{time.monotonic() - start:.0f} s", flush=True)
        for index in checks["end"]:
            for _ in range(args.repeats):
                measure(index)
        # The bubbles of the simulated pipeline cases, from every stage's timeline.
        bubbles = {index: pipeline_bubbles(cases[index], record, args.repeats)
                   for index, record in records.items()
                   if cases[index]["simulate_ms"] is not None}
        rows = [summarise_pipeline(case, seconds[i], order[i], bubbles.get(i), world_size)
                if case["case"] in PIPELINE_CASES else
                summarise(case, seconds[i], order[i], held[i], world_size)
                for i, case in enumerate(cases)]
        if rank == 0:
            for case, row in zip(cases, rows, strict=True):
                if case["case"] in PIPELINE_CASES:
                    result = (f"{row['samples_per_s']:.1f} samples/s "
                              f"({row['samples_per_s_min']:.1f}-{row['samples_per_s_max']:.1f})")
                    if row["bubble"] is not None:
                        result += (f", bubble {row['bubble']:.3f} ({row['bubble_min']:.3f}-"
                                   f"{row['bubble_max']:.3f}), formula "
                                   f"{row['bubble_formula']:.3f}")
                elif case["case"] == "allreduce":
                    result = (f"busbw {row['busbw_GBps']:.3f} GB/s" if row["busbw_GBps"] is not None
                              else f"algbw {row['algbw_GBps']:.3f} GB/s (busbw N/A with 1 rank)")
                else:
                    result = (f"{row['samples_per_s']:.1f} samples/s "
                              f"({row['samples_per_s_min']:.1f}-{row['samples_per_s_max']:.1f})")
                print(f"[{case['index']}/{total}] {describe(case)} ... {result}", flush=True)
            with open(partial_path, "w") as f:
                json.dump(rows, f)
        failed = False
    finally:
        leave_group(failed)
    # As the lessons' leave_process: gloo's threads can abort a finished rank while Python tears
    # down the interpreter (torch 2.14; tools/repro_teardown.py, pytorch/pytorch#190489), so
    # flush and leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_ranks(fn, args, nprocs, resnet):
    """Lesson 02's start_ranks, not joined: nprocs ranks forked from one server that imported
    this file (and with it torch) once, and kept for every world size of the run. Spawn
    where there is no fork (Windows) or it is not the default (macOS), as lesson 02 says."""
    if sys.platform != "linux":
        return mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    # __main__: this file and all it imports; DDP's constructor imports torch._dynamo.
    mp.set_forkserver_preload(["__main__", "torch._dynamo"] + ["torchvision.models"] * resnet)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False,
                              start_method="forkserver")


def run_world_size(world_size, backend, cases, total, args):
    """Start world_size ranks for these cases; wait for them, bounded; return their rows."""
    partial_path = os.path.join(args.out_dir, f".rows-ws{world_size}.json")
    if os.path.exists(partial_path):
        os.remove(partial_path)
    print(f"world size {world_size}: starting {world_size} rank(s) ({backend}) for "
          f"{len(cases)} case(s), {args.repeats} round(s)", flush=True)
    context = start_ranks(worker, (world_size, backend, cases, total, args, partial_path,
                                   find_free_port()), world_size, resnet="resnet18" in args.models)
    # Every case's build and each of its repeats may take up to --timeout seconds; past that,
    # stop the ranks instead of hanging.
    deadline = time.monotonic() + args.timeout * (len(cases) * (args.repeats + 1) + 1)
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                fail(f"world size {world_size} took longer than {args.timeout} s per repeat; the "
                     "ranks were stopped. Is the machine busy? Try --quick or a larger --timeout")
    except mp.ProcessRaisedException as error:
        print(error, file=sys.stderr)
        if "OutOfMemoryError" in str(error):
            fail(f"rank {error.error_index} ran out of GPU memory at world size {world_size} "
                 "(traceback above); use a smaller --batch-size or --image-size")
        fail(f"rank {error.error_index} failed at world size {world_size} (its traceback is "
             "above); the other ranks were stopped")
    except mp.ProcessExitedException as error:
        # A negative exit code is the signal that ended the rank: SIGABRT (-6) is how NCCL's
        # watchdog ends a rank whose collective waited past --timeout, SIGKILL (-9) often the
        # out-of-memory killer.
        fail(f"rank {error.error_index} died with exit code {error.exit_code} at world size "
             f"{world_size} (-6: a collective waited longer than --timeout; -9: killed, often "
             "for lack of memory); the other ranks were stopped")
    with open(partial_path) as f:
        rows = json.load(f)
    os.remove(partial_path)
    return rows


def plan_cases(args, device_type, cores):
    """Every measurement, grouped by the world size whose ranks run it.

    Returns ({world_size: [case]}, backend, skipped), where skipped lists the cases left out
    because they would measure nothing, each with the reason."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    world_sizes = range(1, args.max_world_size + 1)
    top = args.max_world_size
    plan = {world_size: [] for world_size in world_sizes}
    skipped = []

    def training(model, case, world_size, threads=None, batch=None, knob=None, value=None,
                 accumulate=1, run_in=None):
        batch = batch or args.batch_size
        # The ranks that read batches of their own: all of them, but for tp and 2d only one rank
        # per TP group (dp of them), since the ranks of a TP group read the same batch and
        # compute one step of one model together. Its samples/s counts that batch once.
        readers = (tensor_layout(case, world_size)[0] if case in TENSOR_PARALLEL
                   else world_size)
        steps = args.steps if model == "resnet18" else args.mlp_steps
        images = model == "resnet18"
        case = {
            "case": case, "model": model, "knob": knob,
            "knob_value": None if value is None else str(value), "world_size": world_size,
            "backend": backend, "device": device_type,
            # The ranks share the cores evenly, so that more ranks do not simply mean more
            # threads than cores fighting each other. 1 rank gets every core.
            "threads_per_rank": threads or max(1, cores // world_size),
            "batch_per_rank": batch, "global_batch": batch * readers, "accumulate": accumulate,
            # no_sync runs at least as many forward/backward passes as the others, in fewer
            # optimizer steps.
            "steps": -(-steps // accumulate) * accumulate, "warmup": args.warmup,
            # bf16 and channels_last are for ResNet-18's images; the MLP measures DDP's fixed
            # cost per step, in fp32 everywhere.
            "image_size": args.image_size if images else None,
            "precision": args.precision if images else "fp32",
            # FSDP2 cannot shard channels_last parameters: fully_shard raises "FSDP does not
            # support non-contiguous parameters yet" (torch 2.14; tools/repro_fsdp_channels_last.py,
            # pytorch/pytorch#137382), so its rows keep the default layout, and say so.
            "channels_last": args.channels_last and images and case != "fsdp",
        }
        plan[run_in or world_size].append(case)
        return case

    # The noise check's case: the plain model in one process with every core, so that another
    # program on any core slows it. It is measured in the last launch (the longest, where the
    # per-worker cases and the knobs are), before its rounds and again after them, its other
    # ranks waiting: in one process, because the same case measured in two launches can differ
    # by several per cent by itself (benchmarks/README.md): the launches differ in the other
    # cases each process holds and runs.
    noise_model = "resnet18" if "resnet18" in args.models else args.models[0]
    for model in args.models:
        plain = training(model, "plain", 1)
        if model == noise_model:
            noise_case = plain
        for world_size in world_sizes:
            training(model, "ddp", world_size)
            # Lesson 07's sharded strategies, on the same ranks, threads and batch as DDP.
            for strategy in args.sharded:
                training(model, strategy, world_size)
            # Lesson 09's layouts, on the same ranks, threads and batch per rank, where the
            # world size has the layout (tensor_parallel_sizes).
            for layout in args.tensor_parallel if model == "wine-mlp" else []:
                if world_size in tensor_parallel_sizes(layout, top):
                    training(model, layout, world_size)
        if device_type == "cpu":
            # One process with every core and the largest DDP run's global batch: the same work
            # per step, without DDP. On a laptop this is the number to beat.
            training(model, "single-process-all-cores", 1, threads=cores,
                     batch=args.batch_size * top)
            # Every rank with the same few threads, 1 rank as well as N: what DDP scales, each
            # rank bringing its own cores, as each GPU does. Efficiency = samples/s of N ranks
            # / (N x samples/s of 1 rank). Its ceiling: N plain processes at once, each with
            # the same threads and batch, that never communicate; their summed samples/s is
            # what N workers can reach on this machine (shared memory bandwidth, caches,
            # turbo), whatever DDP does. All of them run in the N-rank launch, interleaved.
            if top > 1:
                for world_size in world_sizes:
                    for case in ("ddp-per-worker", "ceiling"):
                        training(model, case, world_size, threads=args.threads_per_worker,
                                 run_in=top)
        else:
            # One process drives `gpus` GPUs, so it runs with the single-rank group; its
            # world_size column counts GPUs, to line it up with DDP on as many. On one GPU,
            # DataParallel calls the model itself (no replica, no thread): no measurement.
            for gpus in world_sizes[1:]:
                training(model, "dataparallel", gpus, threads=cores, run_in=1)
    if device_type == "cpu" and top == 1:
        skipped.append("per-worker scaling (ddp-per-worker): it compares 1 rank with N; "
                       "use --max-world-size 2 or more")
    if device_type == "cuda" and top == 1:
        skipped.append("nn.DataParallel: on one GPU it calls the model itself, so it would "
                       "only repeat the plain model; it needs 2 or more GPUs")

    if args.tensor_parallel and "resnet18" in args.models:
        skipped.append(f"resnet18 {', '.join(args.tensor_parallel)}: lesson 09's plan splits "
                       "Linear layers (fc1 column-wise, fc2 row-wise), not convolutions; "
                       "ResNet-18 has no tensor-parallel case")
    for layout in args.tensor_parallel if "wine-mlp" in args.models else []:
        left_out = [size for size in world_sizes if size not in tensor_parallel_sizes(layout, top)]
        if left_out:
            sizes = ", ".join(map(str, left_out))
            why = (f"one TP group of every rank needs 2 or more ranks that divide fc1's "
                   f"{HIDDEN} hidden units" if layout == "tp" else
                   f"dp x tp with tp = {TP_2D} needs an even world size of 4 or more"
                   + ("; use --max-world-size 4" if top < 4 else ""))
            skipped.append(f"wine-mlp {layout} at world size(s) {sizes}: {why}")

    knob_model = "resnet18" if "resnet18" in args.models else args.models[0]
    if args.sharded and top == 1:
        skipped.append(f"nothing to shard over ({', '.join(args.sharded)} run, but with 1 rank "
                       "they hold what DDP holds); use --max-world-size 2 or more to see 1/N")
    if args.knobs and top == 1:
        skipped.append(f"DDP knobs ({', '.join(args.knobs)}): they change how ranks exchange "
                       "gradients, and one rank exchanges nothing; they need 2 or more ranks")
    for knob in args.knobs if top > 1 else []:
        if knob == "bucket_cap_mb":
            for megabytes in (1, 100):
                training(knob_model, "ddp", top, knob=knob, value=megabytes)
        elif knob == "no_sync":
            training(knob_model, "ddp", top, knob=knob, value=args.accumulate,
                     accumulate=args.accumulate)
        else:
            training(knob_model, "ddp", top, knob=knob, value=True)

    # Lesson 08's modes, each rank with the per-worker threads on the CPU, side by side with
    # ddp-per-worker and the ceiling in the same launch.
    if args.grad_sync and top == 1:
        skipped.append(f"lesson 08's --grad-sync ({', '.join(args.grad_sync)}): one rank has "
                       "no gradients to average with; it needs 2 or more ranks")
    for mode in args.grad_sync if top > 1 else []:
        training(knob_model, "lesson08", top, knob="grad_sync", value=mode,
                 threads=args.threads_per_worker if device_type == "cpu" else None)

    # Bandwidth only where a link is crossed, at 2+ ranks: with one rank an all-reduce copies
    # nothing anywhere. On GPUs NCCL and gloo are compared on the same GPU tensors.
    backends = ["nccl", "gloo"] if device_type == "cuda" else ["gloo"]
    if top == 1:
        skipped.append("all-reduce bandwidth: one rank has no one to exchange with; it needs "
                       "2 or more ranks" + (" (GPUs)" if device_type == "cuda" else ""))
    for world_size in world_sizes[1:]:
        for bw_backend in backends:
            for size in args.allreduce_sizes:
                plan[world_size].append({
                    "case": "allreduce", "backend": bw_backend, "device": device_type,
                    "world_size": world_size, "size_bytes": size, "iters": args.allreduce_iters,
                    "warmup": 2, "threads_per_rank": max(1, cores // world_size)})
    # Lesson 10's schedules at every world size p of 2 or more where they fit, each in the p-rank
    # launch beside one process running the same micro-batches in turn (the other ranks
    # waiting), with the same threads per rank; each simulated and not.
    if args.pipeline and top == 1:
        skipped.append(f"pipeline ({', '.join(args.pipeline)}): one rank holds the whole model, "
                       "a pipeline of one stage; it needs 2 or more ranks")
    simulated = [args.simulate_ms, None]
    for world_size in world_sizes[1:] if args.pipeline else []:
        fits = [s for s in args.pipeline if not pipeline_problem(s, world_size, args)]
        reasons = {}  # the schedules left out, by reason
        for schedule in (s for s in args.pipeline if s not in fits):
            reasons.setdefault(pipeline_problem(schedule, world_size, args), []).append(schedule)
        for reason, left_out in reasons.items():
            skipped.append(f"pipeline {', '.join(left_out)} at world size {world_size}: {reason}")
        for simulate_ms in simulated if fits else []:
            for case, schedule in [("one-process", "afab")] + [("pipeline", s) for s in fits]:
                stages = world_size if case == "pipeline" else 1
                plan[world_size].append({
                    "case": case, "model": "wine-mlp", "schedule": schedule, "knob": None,
                    "world_size": stages, "stages": stages,
                    "chunks": 2 if schedule == "interleaved" else 1, "backend": backend,
                    "device": device_type, "threads_per_rank": max(1, cores // world_size),
                    "layers": args.pipeline_layers, "microbatches": args.microbatches,
                    "global_batch": args.batch_size, "simulate_ms": simulate_ms,
                    "steps": args.pipeline_steps if simulate_ms is None else args.bubble_steps,
                    # A simulated step sleeps for long: one warm-up step sets the pipeline up.
                    "warmup": args.warmup if simulate_ms is None else 1})
    plan[top] = [{**noise_case, "noise_check": "start"}, *plan[top],
                 {**noise_case, "noise_check": "end"}]
    index = 0
    for world_size in world_sizes:
        for case in plan[world_size]:
            index += 1
            case["index"] = index
    return {world_size: cases for world_size, cases in plan.items() if cases}, backend, skipped


def tensor_parallel_sizes(layout, top):
    """The world sizes 1..top at which lesson 09's layout runs: tp at 2+ ranks that divide the
    hidden units (fc2 is row-wise: its 3 outputs are whole on every rank, its 64 inputs split),
    2d at even world sizes of 4 or more (dp = world size / 2, at least 2)."""
    if layout == "tp":
        return [n for n in range(2, top + 1) if HIDDEN % n == 0]
    return [n for n in range(2 * TP_2D, top + 1) if n % TP_2D == 0 and HIDDEN % TP_2D == 0]


def bubble_formula(stages, chunks, microbatches):
    """The bubble of a schedule with no overheads: of the v*m + p - 1 slots a stage's work
    spreads over (each of its v chunks' m micro-batches, plus p - 1 while the pipeline fills
    and drains), p - 1 are idle."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


def pipeline_problem(schedule, stages, args):
    """Why lesson 10's schedule cannot run on this many stages, or None (its check_pipeline's
    rules): the linear layers split evenly over the stages (interleaved: 2 per rank), 1f1b and
    interleaved need a micro-batch per stage, interleaved a multiple of the stages."""
    pieces, linears = stages * (2 if schedule == "interleaved" else 1), args.pipeline_layers + 1
    if linears % pieces:
        return f"{linears} linear layers (--pipeline-layers {args.pipeline_layers}) do not " \
               f"split evenly into {pieces} stages"
    if schedule in ("1f1b", "interleaved") and args.microbatches < stages:
        return f"{schedule} needs at least one micro-batch per stage (--microbatches " \
               f"{args.microbatches})"
    if schedule == "interleaved" and args.microbatches % stages:
        return f"interleaved runs micro-batches in rounds of the stages (--microbatches " \
               f"{args.microbatches} is not a multiple of {stages})"
    return None


# ---------------------------------------------------------------------------------------------
# Results: speed-ups, files, table, plot
# ---------------------------------------------------------------------------------------------
def find_row(rows, model, case, world_size):
    """The row of this case at this world size with DDP's default settings (no knob)."""
    return next((r for r in rows if (r["model"], r["case"], r["world_size"]) ==
                 (model, case, world_size) and r["knob"] is None), None)


def add_speedups(rows):
    """Speed-up and efficiency against one rank, efficiency against the ceiling, vs_default, and
    DDP's own cost at 1 rank; all from the medians."""
    for row in rows:
        # ddp-per-worker, ceiling, zero1 and fsdp are compared with their own 1 rank; every
        # other case with DDP at 1 rank (on CPU, with every core).
        own = row["case"] in ("ddp-per-worker", "ceiling", *SHARDED)
        base = find_row(rows, row["model"], row["case"] if own else "ddp", 1)
        default = find_row(rows, row["model"], "ddp", row["world_size"])
        ceiling = find_row(rows, row["model"], "ceiling", row["world_size"])
        if base:
            row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
            # Ideal: N ranks (or GPUs) do N times the work of one, efficiency 1.0. A single
            # process has no N to divide by.
            if row["case"] not in ("plain", "single-process-all-cores"):
                row["efficiency"] = row["speedup"] / row["world_size"]
        # DDP (any knob), ZeRO-1, FSDP, TP or 2-D against N independent processes with the same
        # threads and batch per rank: 1.0 is all that this machine allows N workers, so what is
        # missing is what the communication costs. (A TP group of N that split each batch's
        # work evenly would reach it: each rank's share of a step, 1/N of the work, in 1/N of
        # the time.)
        if (ceiling and row["case"] not in (*ALONE, "dataparallel")
                and (row["threads_per_rank"], row["batch_per_rank"]) ==
                (ceiling["threads_per_rank"], ceiling["batch_per_rank"])):
            row["efficiency_vs_ceiling"] = row["samples_per_s"] / ceiling["samples_per_s"]
        # A knob, a sharded strategy or a TP layout, against DDP with default settings on as
        # many ranks. (tp and 2d have no 1-rank case of their own: their speed-up is against
        # DDP at 1 rank, the same model's step in one process.)
        if default and (row["knob"] is not None or row["case"] in (*SHARDED, *TENSOR_PARALLEL)):
            row["vs_default"] = row["samples_per_s"] / default["samples_per_s"]
        # What wrapping the model in DDP costs when there is nobody to talk to: DDP with 1 rank
        # against the plain model with the same threads, same loop, measured side by side
        # (every core: plain; per worker: the ceiling's one process).
        alone = {"ddp": "plain", "ddp-per-worker": "ceiling"}.get(row["case"])
        plain = alone and find_row(rows, row["model"], alone, 1)
        if plain and row is find_row(rows, row["model"], row["case"], 1):
            row["ddp_cost_pct"] = 100 * (1 - row["samples_per_s"] / plain["samples_per_s"])
    return rows


def add_pipeline_speedups(rows):
    """speedup = samples/s / that of one process with the same micro-batches, threads and
    simulation, measured in the same launch; ideal_speedup (simulated rows) = p x (1 - the
    bubble's formula): p stages that each sleep 1/p of the model's time, idle that share."""
    for row in rows:
        base = next((r for r in rows if r["case"] == "one-process" and
                     (r["processes"], r["simulate_ms"]) == (row["processes"], row["simulate_ms"])),
                    None)
        if base:
            row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        if row["simulate_ms"] is not None:
            row["ideal_speedup"] = row["stages"] * (1 - row["bubble_formula"])
    return rows


def write_rows(rows, fields, stem, out_dir):
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        # A list (each repeat's figure, in order) is one cell, its numbers separated by spaces.
        writer.writerows({k: " ".join(map(str, v)) if isinstance(v, list) else v
                          for k, v in row.items()} for row in rows)


def format_bytes(size):
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def number(value, spec):
    return "N/A" if value is None else format(value, spec)


def spread(row):
    return f"{row['samples_per_s_min']:.1f}-{row['samples_per_s_max']:.1f}"


def print_tables(rows, bandwidth_rows):
    print("\nTraining throughput: samples/s is the median of the repeats, min-max their spread. "
          "Speed-up and efficiency (= speed-up / world size) against 1 rank of DDP, or for "
          "ddp-per-worker, ceiling, zero1 and fsdp against 1 rank of the same case; vs ceiling = "
          "against as many independent processes with the same threads and batch; vs default = "
          "against DDP with default settings at the same world size; DDP cost = 1 - DDP/plain "
          "at world size 1; tp and 2d count each TP group's batch once (batch = batch per rank "
          "x dp)")
    header = (f"{'model':9} {'case':30} {'ws':>3} {'thr':>4} {'batch':>6} {'samples/s':>10} "
              f"{'min-max':>15} {'speed-up':>9} {'effic.':>7} {'vs ceil.':>8} "
              f"{'vs default':>10} {'DDP cost':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        name = case_name(row)
        cost = "" if row["ddp_cost_pct"] is None else f"{row['ddp_cost_pct']:.1f}%"
        print(f"{row['model']:9} {name:30} {row['world_size']:3d} {row['threads_per_rank']:4d} "
              f"{row['global_batch']:6d} {row['samples_per_s']:10.1f} {spread(row):>15} "
              f"{number(row['speedup'], '9.2f'):>9} {number(row['efficiency'], '7.2f'):>7} "
              f"{number(row['efficiency_vs_ceiling'], '8.2f'):>8} "
              f"{number(row['vs_default'], '10.2f'):>10} {cost:>8}")
    print()
    for model in dict.fromkeys(row["model"] for row in rows):
        for case, alone, what in (("ddp", "plain", "every core"),
                                  ("ddp-per-worker", "ceiling", "per worker")):
            plain, ddp = find_row(rows, model, alone, 1), find_row(rows, model, case, 1)
            if plain and ddp:
                print(f"{model}: {what}, DDP at world size 1 runs at {ddp['samples_per_s']:.1f} "
                      f"samples/s ({spread(ddp)}), the plain model at "
                      f"{plain['samples_per_s']:.1f} ({spread(plain)}): DDP's own cost is "
                      f"{ddp['ddp_cost_pct']:.1f}% (nobody to talk to; what is left is the "
                      f"wrapper)")
        per_worker = sorted((r for r in rows if r["model"] == model
                             and r["case"] == "ddp-per-worker"), key=lambda r: r["world_size"])
        if len(per_worker) > 1:
            one, top = per_worker[0], per_worker[-1]
            print(f"{model}: per worker ({one['threads_per_rank']} thread(s) per rank), "
                  f"{top['world_size']} ranks run {top['samples_per_s']:.1f} samples/s "
                  f"({spread(top)}) against {one['samples_per_s']:.1f} ({spread(one)}) for 1 "
                  f"rank: DDP's efficiency {top['efficiency']:.0%} = "
                  f"{top['samples_per_s']:.1f} / ({top['world_size']} x "
                  f"{one['samples_per_s']:.1f})")
            ceiling = find_row(rows, model, "ceiling", top["world_size"])
            if ceiling:
                print(f"{model}: ceiling, {ceiling['world_size']} independent processes at "
                      f"once (no communication) run {ceiling['samples_per_s']:.1f} samples/s "
                      f"({spread(ceiling)}), {ceiling['efficiency']:.0%} of "
                      f"{ceiling['world_size']} x one process alone: DDP's efficiency against "
                      f"this ceiling is {top['efficiency_vs_ceiling']:.0%}")
            tuned = [r for r in rows if r["model"] == model and r["world_size"] == top["world_size"]
                     and r["case"] == "ddp" and r["knob"] is not None
                     and r["efficiency_vs_ceiling"] is not None]
            if tuned:
                best = max(tuned, key=lambda r: r["efficiency_vs_ceiling"])
                print(f"{model}: the knob closest to the ceiling is {best['knob']}="
                      f"{best['knob_value']}, at {best['efficiency_vs_ceiling']:.0%} of it")
            all_cores = find_row(rows, model, "single-process-all-cores", 1)
            shared = find_row(rows, model, "ddp", top["world_size"])
            if all_cores and shared:
                print(f"{model}: all cores, one process with {all_cores['threads_per_rank']} "
                      f"threads and batch {all_cores['global_batch']} runs "
                      f"{all_cores['samples_per_s']:.1f} samples/s; {shared['world_size']} DDP "
                      f"ranks sharing the same cores run {shared['samples_per_s']:.1f}")
        # The ceiling trains N separate models: not a way to train this one.
        best = max((r for r in rows if r["model"] == model and r["knob"] is None
                    and r["case"] != "ceiling"), key=lambda r: r["samples_per_s"])
        print(f"{model}: fastest is {best['case']} with world size {best['world_size']}, "
              f"{best['samples_per_s']:.1f} samples/s")
    print_memory(rows)
    if bandwidth_rows:
        print("\nAll-reduce bandwidth (time/op: the median of the repeats, min-max their "
              "spread; algbw = bytes / time; busbw = algbw * 2(n-1)/n, as nccl-tests defines "
              "it; N/A with 1 rank)")
        header = (f"{'backend':8} {'device':6} {'ws':>3} {'size':>10} {'time/op':>11} "
                  f"{'min-max, ms':>17} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        print(header)
        print("-" * len(header))
        for row in bandwidth_rows:
            print(f"{row['backend']:8} {row['device']:6} {row['world_size']:3d} "
                  f"{format_bytes(row['size_bytes']):>10} "
                  f"{row['seconds_per_op'] * 1e3:8.3f} ms "
                  f"{row['seconds_per_op_min'] * 1e3:8.3f}-{row['seconds_per_op_max'] * 1e3:.3f}"
                  f" {row['algbw_GBps']:11.3f} "
                  f"{number(row['busbw_GBps'], '11.3f'):>11}")


def print_pipeline(rows):
    """Lesson 10's schedules: the bubble against its formula, samples/s with and without the
    simulated compute, each against one process running the same micro-batches."""
    if not rows:
        return
    first = rows[0]
    print(f"\nPipeline (lesson 10): the wine MLP with --layers {first['layers']} "
          f"({first['layers'] + 1} linear layers), batch {first['global_batch']} in "
          f"{first['microbatches']} micro-batches; median of the repeats (min-max). bubble: "
          "idle share of the p ranks' time per step, with each layer sleeping "
          f"{number(first['simulate_ms'], 'g')} ms forward and "
          "twice that backward, against (p - 1) / (v*m + p - 1); speed-up: against one process "
          "running the same micro-batches in turn, same threads, measured in the same launch; "
          "ideal: p x (1 - formula)")
    header = (f"{'schedule':12} {'p x v':>5} {'formula':>7} {'bubble':>6} {'min-max':>11} "
              f"{'sim. samples/s':>14} {'min-max':>13} {'speed-up':>8} {'ideal':>5} "
              f"{'samples/s':>9} {'min-max':>15} {'speed-up':>8}")
    print(header)
    print("-" * len(header))
    pairs = {}
    for row in rows:
        key = (row["processes"], row["case"], row["schedule"])
        pairs.setdefault(key, {})["sim" if row["simulate_ms"] is not None else "plain"] = row
    for (_, case, schedule), pair in pairs.items():
        sim, plain = pair.get("sim"), pair.get("plain")
        any_row = sim or plain
        name = schedule if case == "pipeline" else "one process"
        columns = f"{name:12} {any_row['stages']:>3}x{any_row['chunks']} " \
                  f"{any_row['bubble_formula']:7.3f} "
        if sim:
            columns += (f"{sim['bubble']:6.3f} {sim['bubble_min']:.3f}-{sim['bubble_max']:.3f} "
                        f"{sim['samples_per_s']:14.1f} {spread(sim):>13} "
                        f"{number(sim['speedup'], '8.2f'):>8} "
                        f"{number(sim['ideal_speedup'], '5.2f'):>5} ")
        else:
            columns += f"{'':6} {'':11} {'':14} {'':13} {'':8} {'':5} "
        if plain:
            columns += (f"{plain['samples_per_s']:9.1f} {spread(plain):>15} "
                        f"{number(plain['speedup'], '8.2f'):>8}")
        print(columns)


def held_bytes(row):
    """Parameters, gradients and optimizer state: what a rank holds between steps."""
    return row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"]


def print_memory(rows):
    """What each rank holds under DDP, ZeRO-1, FSDP, TP and 2-D, and what sharding costs in
    samples/s."""
    split = (*SHARDED, *TENSOR_PARALLEL)
    cases, models = ("ddp", *split), list(dict.fromkeys(r["model"] for r in rows))
    mine = sorted((r for r in rows if r["case"] in cases and r["knob"] is None),
                  key=lambda r: (models.index(r["model"]), r["world_size"], cases.index(r["case"])))
    if not any(r["case"] in split for r in mine):
        return
    print("\nMemory per rank, MiB (the most loaded rank, after the last step; optimizer: SGD's "
          "momentum, one tensor per parameter; peak: torch.cuda.max_memory_allocated, N/A on "
          "the CPU)")
    header = (f"{'model':9} {'case':6} {'ws':>3} {'parameters':>11} {'gradients':>10} "
              f"{'optimizer':>10} {'total':>9} {'vs ddp':>7} {'peak':>9} {'samples/s':>10}")
    print(header)
    print("-" * len(header))
    mib = 2**20
    for row in mine:
        held = held_bytes(row)
        ddp_held = held_bytes(find_row(rows, row["model"], "ddp", row["world_size"]))
        peak = "N/A" if row["peak_bytes"] is None else f"{row['peak_bytes'] / mib:.1f}"
        print(f"{row['model']:9} {row['case']:6} {row['world_size']:3d} "
              f"{row['parameter_bytes'] / mib:11.3f} {row['gradient_bytes'] / mib:10.3f} "
              f"{row['optimizer_bytes'] / mib:10.3f} {held / mib:9.3f} {held / ddp_held:7.0%} "
              f"{peak:>9} {row['samples_per_s']:10.1f}")
    top = max(r["world_size"] for r in mine)
    for model in dict.fromkeys(r["model"] for r in mine):
        ddp = find_row(rows, model, "ddp", top)
        for case in split:
            row = find_row(rows, model, case, top)
            if row and ddp:
                share = held_bytes(row) / held_bytes(ddp)
                print(f"{model}: {case} on {top} ranks holds {share:.0%} of DDP's "
                      f"parameters, gradients and optimizer state per rank, at "
                      f"{row['vs_default']:.2f} x DDP's samples/s")


def plot(rows, bandwidth_rows, path):
    """samples/s against world size per model, each point the median with its spread as an
    error bar (min to max); the all-reduce bandwidth."""
    # Imported here: only the launching process plots, and the ranks skip matplotlib's import.
    import matplotlib

    matplotlib.use("Agg")  # write a file; no window, no display needed
    import matplotlib.pyplot as plt

    def curve(ax, points, fmt, **style):
        points = sorted(points, key=lambda r: r["world_size"])
        ax.errorbar([r["world_size"] for r in points], [r["samples_per_s"] for r in points],
                    yerr=[[r["samples_per_s"] - r["samples_per_s_min"] for r in points],
                          [r["samples_per_s_max"] - r["samples_per_s"] for r in points]],
                    fmt=fmt, capsize=3, **style)

    models = list(dict.fromkeys(row["model"] for row in rows))
    panels = len(models) + (1 if bandwidth_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        mine = [r for r in rows if r["model"] == model and r["knob"] is None]
        ddp = sorted((r for r in mine if r["case"] == "ddp"), key=lambda r: r["world_size"])
        sizes = [r["world_size"] for r in ddp]
        curve(ax, ddp, "o-",
              label="DDP" if ddp[0]["device"] == "cuda" else "DDP, ranks sharing the cores")
        ax.plot(sizes, [ddp[0]["samples_per_s"] * w for w in sizes], "k--", alpha=0.5,
                label="ideal linear scaling")
        per_worker = sorted((r for r in mine if r["case"] == "ddp-per-worker"),
                            key=lambda r: r["world_size"])
        if per_worker:
            threads = per_worker[0]["threads_per_rank"]
            curve(ax, per_worker, "^-", color="tab:purple",
                  label=f"DDP, {threads} thread(s) per rank (per worker)")
            ax.plot(sizes, [per_worker[0]["samples_per_s"] * w for w in sizes], ":",
                    color="tab:purple", alpha=0.5, label="its ideal linear scaling")
            curve(ax, [r for r in mine if r["case"] == "ceiling"], "x--", color="tab:gray",
                  label="ceiling: as many independent processes, no communication")
        for case, marker, style in (
                ("zero1", "v-", {"label": "ZeRO-1"}), ("fsdp", "D-", {"label": "FSDP"}),
                ("tp", "P-", {"label": "TP, one group of all ranks", "color": "tab:brown"}),
                ("2d", "*-", {"label": f"2-D, dp x tp with tp = {TP_2D}",
                              "color": "tab:olive"})):
            sharded = [r for r in mine if r["case"] == case]
            if sharded:
                curve(ax, sharded, marker, **style)
        dataparallel = [r for r in mine if r["case"] == "dataparallel"]
        if dataparallel:
            curve(ax, dataparallel, "s-", label="DataParallel")
        for row in (r for r in mine if r["case"] in ("plain", "single-process-all-cores")):
            color = "tab:green" if row["case"] == "plain" else "tab:red"
            ax.axhline(row["samples_per_s"], linestyle=":", color=color,
                       label=f"{row['case']} ({row['threads_per_rank']} threads, "
                             f"batch {row['global_batch']})")
            ax.axhspan(row["samples_per_s_min"], row["samples_per_s_max"], color=color,
                       alpha=0.15)
        ax.set_title(f"{model} ({ddp[0]['device']}, {ddp[0]['backend']}; median, min-max)")
        ax.set_xlabel("world size (ranks; GPUs for DataParallel)")
        ax.set_ylabel("samples / s")
        ax.set_xticks(sizes)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    if bandwidth_rows:
        ax = axes[0][-1]
        series = dict.fromkeys((r["backend"], r["device"], r["world_size"])
                               for r in bandwidth_rows)
        for backend, device, world_size in series:
            mine = [r for r in bandwidth_rows if (r["backend"], r["device"], r["world_size"])
                    == (backend, device, world_size)]
            key = "busbw_GBps" if world_size > 1 else "algbw_GBps"
            # Bandwidth is bytes / time: the fastest repeat gives the top of the bar.
            ax.errorbar([r["size_bytes"] for r in mine], [r[key] for r in mine],
                        yerr=[[r[key] * (1 - r["seconds_per_op"] / r["seconds_per_op_max"])
                               for r in mine],
                              [r[key] * (r["seconds_per_op"] / r["seconds_per_op_min"] - 1)
                               for r in mine]],
                        fmt="o-", capsize=3,
                        label=f"{backend} {device} ws={world_size} ({key.split('_')[0]})")
        ax.set_xscale("log", base=2)
        ax.set_title("all-reduce bandwidth (median, min-max)")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def noise_check(what, start, end, load, limit_pct=NOISE_LIMIT_PCT):
    """Did the machine hold still? start and end: the medians, in samples/s, of the same case
    measured before the last launch's rounds and after them.

    Returns (difference in % of start, message): message is None when the two agree within
    limit_pct; otherwise one line saying that the machine was too busy for the run's figures,
    with its load average (os.getloadavg: processes running or waiting for a core, averaged
    over 1, 5 and 15 minutes) and what to do."""
    difference = 100 * (end - start) / start
    if abs(difference) <= limit_pct:
        return difference, None
    averages = "unknown" if load is None else ", ".join(f"{value:.2f}" for value in load)
    return difference, (
        f"too busy: the machine was too busy for these figures: {what} ran {start:.1f} "
        f"samples/s before the rounds and {end:.1f} after them, {difference:+.1f}% (more "
        f"than {limit_pct:g}%); load average {averages} (1, 5, 15 min). Stop what else runs "
        f"(top lists it), wait until the 1-minute load average is well below the number of "
        f"cores, and run again")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(args):
    start = time.time()
    load_start = load_average()
    cores = cpu_cores()
    gpus = torch.cuda.device_count()
    device_type = args.device_type
    plan, backend, skipped = plan_cases(args, device_type, cores)
    total = sum(len(cases) for cases in plan.values())
    os.makedirs(args.out_dir, exist_ok=True)

    print(f"machine: {cpu_name()}, {cores} cores, {gpus} GPU(s); torch {torch.__version__}; "
          f"load average {load_start}", flush=True)
    if device_type == "cpu":
        reason = ("no CUDA GPU is visible (torch.cuda.device_count() == 0)" if gpus == 0
                  else "--device cpu was given")
        print(f"GPU cases (NCCL DDP, DataParallel, NCCL vs gloo on GPU tensors) skipped: "
              f"{reason}", flush=True)
    if args.quick:
        print("quick mode: fewer steps (and on the CPU smaller inputs), so the figures are "
              "rough; run without --quick for the full measurement", flush=True)
    if "resnet18" in args.models:
        layout = "channels_last" if args.channels_last else "contiguous (NCHW)"
        print(f"resnet18: random {args.image_size}x{args.image_size} images, batch "
              f"{args.batch_size} per rank, {args.steps} timed steps per repeat after "
              f"{args.warmup} warm-up steps, {args.precision}"
              f"{' autocast' if args.precision == 'bf16' else ''}, {layout}"
              f"{', cudnn.benchmark' if device_type == 'cuda' else ''}", flush=True)
        if args.precision_note:
            print(args.precision_note, flush=True)
        if args.channels_last and "fsdp" in args.sharded:
            print("resnet18 fsdp: contiguous (NCHW), as FSDP2 cannot shard channels_last "
                  "parameters", flush=True)
    if "wine-mlp" in args.models:
        print(f"wine-mlp: random 13-feature rows, batch {args.batch_size} per rank, "
              f"{args.mlp_steps} timed steps per repeat after {args.warmup} warm-up steps",
              flush=True)
        if args.tensor_parallel:
            print(f"wine-mlp {', '.join(args.tensor_parallel)}: lesson 09's layouts; the ranks "
                  f"of a TP group read the same batch, so its samples/s counts it once "
                  f"(global batch = batch per rank x dp)", flush=True)
    if args.pipeline:
        print(f"pipeline {', '.join(args.pipeline)}: lesson 10's schedules on its wine MLP with "
              f"--layers {args.pipeline_layers}, batch {args.batch_size} in "
              f"{args.microbatches} micro-batches, {args.bubble_steps} timed step(s) per repeat "
              f"with each layer sleeping {args.simulate_ms:g} ms forward and twice that "
              f"backward (the bubble), {args.pipeline_steps} without (samples/s)", flush=True)
    for reason in skipped:
        print(f"skipped: {reason}", flush=True)
    print(f"{total} cases over world sizes 1..{args.max_world_size} ({backend}), each the "
          f"median of {args.repeats} repeats, measured in rounds", flush=True)

    results = []
    for world_size, cases in plan.items():
        results += run_world_size(world_size, backend, cases, total, args)
    first, again = (next(r for r in results if r.get("noise_check") == when)
                    for when in ("start", "end"))
    results = [r for r in results if "noise_check" not in r]
    pipeline_rows = add_pipeline_speedups([r for r in results if "schedule" in r])
    rows = add_speedups([r for r in results if "samples_per_s" in r and "schedule" not in r])
    bandwidth_rows = [r for r in results if "algbw_GBps" in r]
    what = f"{first['model']} plain, world size 1, every core"
    difference, too_busy = noise_check(what, first["samples_per_s"], again["samples_per_s"],
                                       load_average())

    write_rows(rows, ROW_FIELDS, "results", args.out_dir)
    write_rows(bandwidth_rows, BANDWIDTH_FIELDS, "allreduce", args.out_dir)
    write_rows(pipeline_rows, PIPELINE_FIELDS, "pipeline", args.out_dir)
    plot(rows, bandwidth_rows, os.path.join(args.out_dir, "scaling.png"))
    run_info = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu_name(), "cores": cores,
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "torch": torch.__version__, "python": sys.version.split()[0],
        "load_average_start": load_start, "load_average_end": load_average(),
        "wall_seconds": time.time() - start,
        "noise_check": {
            "case": what, "limit_pct": NOISE_LIMIT_PCT, "difference_pct": difference,
            "too_busy": too_busy is not None, "message": too_busy,
            **{f"{when}_{field}": row[field] for when, row in (("start", first), ("end", again))
               for field in ("samples_per_s", "samples_per_s_min", "samples_per_s_max",
                             "processes", "repeat_order")}},
        "settings": {k: v for k, v in vars(args).items()},
    }
    with open(os.path.join(args.out_dir, "run.json"), "w") as f:
        json.dump(run_info, f, indent=2)
    print_tables(rows, bandwidth_rows)
    print_pipeline(pipeline_rows)
    print(f"\nnoise check: {what} ran {first['samples_per_s']:.1f} samples/s ({spread(first)}) "
          f"before the last launch's rounds and {again['samples_per_s']:.1f} ({spread(again)}) "
          f"after them, "
          f"{difference:+.1f}%" + (f": within {NOISE_LIMIT_PCT:g}%, the machine held still"
                                   if too_busy is None else ""))
    if too_busy:
        print(too_busy)
    print(f"\ndone in {run_info['wall_seconds']:.0f} s; load average now "
          f"{run_info['load_average_end']} | results in {args.out_dir}", flush=True)


def parse_size(text):
    """'4K', '1M', '64M' or a number of bytes -> bytes."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) * scale < 4:
        fail(f"--allreduce-sizes: {text!r} is not a size; use bytes or K/M/G, e.g. 4K,1M,64M")
    return int(digits) * scale // 4 * 4  # whole float32 elements


def parse_list(text, allowed, flag):
    items = [item.strip() for item in text.split(",") if item.strip()]
    if items == ["none"]:
        return []
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        fail(f"{flag}: unknown {', '.join(unknown) or 'empty list'}; choose from "
             f"{','.join(allowed)}" + (" or none" if flag != "--models" else ""))
    return items


def default_settings(device_type, quick, bf16_supported=False):
    """The defaults of the flags that depend on the device, as {name: value}.

    Steps are per repeat: every figure is the median of `repeats` of them. CPU: small inputs,
    so that the full run takes minutes on a 2-core laptop. CUDA: ResNet-18 as
    it is trained on a GPU, 224x224 images, batch 256 per GPU, bf16 autocast and channels_last,
    so that a step keeps the GPU busy. A step of 16 small images is over before Python has
    launched the next kernels: it would time the launches (and make DDP's few hundred
    microseconds of Python per step look like a quarter of the work), not the GPU."""
    if device_type == "cuda":
        # Native bf16 needs compute capability 8.0 (Ampere) or newer; older GPUs stay in fp32.
        precision = "bf16" if bf16_supported else "fp32"
        table = {"batch_size": (256, 256), "image_size": (224, 224), "steps": (20, 10),
                 "warmup": (10, 5), "precision": (precision, precision),
                 "channels_last": (True, True)}
    else:
        table = {"batch_size": (16, 8), "image_size": (112, 64), "steps": (6, 4),
                 "warmup": (3, 2), "precision": ("fp32", "fp32"),
                 "channels_last": (False, False)}
    table.update({"repeats": (5, 3), "mlp_steps": (200, 100), "allreduce_iters": (10, 5),
                  "pipeline_steps": (20, 10), "bubble_steps": (2, 1),
                  "allreduce_sizes": ("4K,64K,1M,16M,64M", "4K,1M,16M")})
    return {name: quick_value if quick else full for name, (full, quick_value) in table.items()}


def cuda_supports_bf16():
    """Whether GPU 0 runs bf16 natively: compute capability 8.0 (Ampere) or newer, the test
    torch.cuda.is_bf16_supported(including_emulation=False) makes; ROCm GPUs all do."""
    return torch.version.hip is not None or torch.cuda.get_device_capability(0)[0] >= 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Measure DDP's samples/s for world sizes 1..N next to a plain model, one "
                    "process with every core and ranks of a few threads each (CPU) or "
                    "DataParallel (GPUs), DDP's knobs and the all-reduce bandwidth. Every "
                    "timing excludes the warm-up steps.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true",
                        help="fewer repeats and steps, and on the CPU smaller inputs: about a "
                             "minute on a 2-core laptop; sets the defaults below marked "
                             "(quick: ...)")
    parser.add_argument("--out-dir", default="runs/benchmarks",
                        help="folder for results.json/.csv, allreduce.json/.csv, run.json and "
                             "scaling.png")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA (NCCL, DataParallel) when GPUs are visible, else CPU "
                             "(gloo)")
    parser.add_argument("--max-world-size", type=int, default=None,
                        help="measure world sizes 1..N (default: one per GPU, or one per CPU "
                             "core)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per step per rank (CPU: 16, quick: 8; GPU: 256)")
    parser.add_argument("--image-size", type=int, default=None,
                        help="side of ResNet-18's random images (CPU: 112, quick: 64; GPU: 224)")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16"],
                        help="ResNet-18's forward pass: fp32, or bf16 autocast (CPU: fp32; GPU: "
                             "bf16 where the GPU runs it natively, compute capability 8.0+)")
    parser.add_argument("--channels-last", default=None, action=argparse.BooleanOptionalAction,
                        help="ResNet-18's weights and images in channels_last (N,H,W,C) memory "
                             "format (CPU: off; GPU: on)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="measurements of every case, taken in rounds (one of each case "
                             "per round); each figure is their median, printed with min-max "
                             "(default 5; quick: 3)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per repeat for ResNet-18 and the knobs (CPU: 6, "
                             "quick: 4; GPU: 20, quick: 10)")
    parser.add_argument("--mlp-steps", type=int, default=None,
                        help="timed steps per repeat for the wine MLP, whose steps take well "
                             "under a millisecond (default 200; quick: 100)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps once per case, before its first repeat; at least 1, "
                             "which allocates memory and lets DDP set up its buckets (CPU: 3, "
                             "quick: 2; GPU: 10, quick: 5)")
    parser.add_argument("--threads-per-worker", type=int, default=None,
                        help="CPU threads of each rank in the per-worker case, where 1 rank and "
                             "N ranks all get this many (default: cores // max world size)")
    parser.add_argument("--knobs", default=",".join(KNOBS),
                        help="DDP settings to measure at the largest world size, comma-separated, "
                             "or none")
    parser.add_argument("--sharded", default=",".join(SHARDED),
                        help="lesson 07's strategies to measure next to DDP at every world size, "
                             "comma-separated, or none")
    parser.add_argument("--tensor-parallel", default=",".join(TENSOR_PARALLEL),
                        help="lesson 09's layouts of the wine MLP to measure next to DDP, "
                             "comma-separated, or none: tp, every rank in one TP group (world "
                             f"sizes 2+ that divide its {HIDDEN} hidden units); 2d, dp x tp "
                             f"with tp = {TP_2D} (even world sizes of 4 or more)")
    parser.add_argument("--grad-sync", default="none",
                        help="lesson 08's gradient synchronisations to measure on ResNet-18 at "
                             "the largest world size (on the CPU with the per-worker threads), "
                             f"comma-separated from {','.join(GRAD_SYNC)}, or none; it imports "
                             "08_ddp_from_scratch/train.py")
    parser.add_argument("--pipeline", default="none",
                        help="lesson 10's schedules to measure at every world size of 2 or "
                             "more where they fit, one stage per rank, comma-separated from "
                             f"{','.join(PIPELINE)}, or none; it imports "
                             "10_pipeline_parallel/train.py")
    parser.add_argument("--pipeline-layers", type=int, default=7,
                        help="hidden layers of lesson 10's wine MLP for --pipeline (its "
                             "--layers): --pipeline-layers + 1 linear layers split over the "
                             "stages")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="micro-batches each --pipeline batch (--batch-size) is cut into")
    parser.add_argument("--simulate-ms", type=float, default=10.0,
                        help="for the bubble of --pipeline: each layer sleeps this long forward "
                             "and twice that backward (lesson 10's --simulate-ms); a sleep "
                             "takes no CPU, so more ranks than cores keep a clean timeline")
    parser.add_argument("--bubble-steps", type=int, default=None,
                        help="timed steps per repeat of a --pipeline case with --simulate-ms; a "
                             "repeat's bubble is the median of its steps' (default 2; quick: 1)")
    parser.add_argument("--pipeline-steps", type=int, default=None,
                        help="timed steps per repeat of a --pipeline case without simulated "
                             "compute (default 20; quick: 10)")
    parser.add_argument("--accumulate", type=int, default=4,
                        help="micro-batches per optimizer step for the no_sync knob")
    parser.add_argument("--allreduce-sizes", default=None,
                        help="all-reduce message sizes (default 4K,64K,1M,16M,64M; quick: "
                             "4K,1M,16M)")
    parser.add_argument("--allreduce-iters", type=int, default=None,
                        help="timed all-reduces per size per repeat (default 10; quick: 5)")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds a case's build or one of its repeats may take before the "
                             "ranks are stopped")
    args = parser.parse_args(argv)

    gpus = torch.cuda.device_count()
    if args.device == "cuda" and gpus == 0:
        fail("--device cuda needs a CUDA GPU and none is visible; use --device cpu")
    if args.device == "cuda" and not dist.is_nccl_available():
        fail("--device cuda needs NCCL, which this torch build lacks; use --device cpu")
    args.device_type = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    on_gpus = args.device_type == "cuda"

    bf16_supported = on_gpus and args.precision != "fp32" and cuda_supports_bf16()
    if on_gpus and args.precision == "bf16" and not bf16_supported:
        major, minor = torch.cuda.get_device_capability(0)
        fail(f"--precision bf16 needs a GPU that runs bf16 natively (compute capability 8.0+, "
             f"e.g. A100, H100); GPU 0 has {major}.{minor}: use --precision fp32")
    args.precision_note = None
    if on_gpus and args.precision is None and not bf16_supported:
        args.precision_note = ("precision: fp32, since GPU 0 has no native bf16 (compute "
                               "capability below 8.0)")
    for name, value in default_settings(args.device_type, args.quick, bf16_supported).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.models = parse_list(args.models, MODELS, "--models")
    args.knobs = parse_list(args.knobs, KNOBS, "--knobs")
    args.sharded = parse_list(args.sharded, SHARDED, "--sharded")
    args.tensor_parallel = parse_list(args.tensor_parallel, TENSOR_PARALLEL, "--tensor-parallel")
    args.grad_sync = parse_list(args.grad_sync, GRAD_SYNC, "--grad-sync")
    args.pipeline = parse_list(args.pipeline, PIPELINE, "--pipeline")
    if args.pipeline and not (LESSON10 / "train.py").exists():
        fail(f"--pipeline needs lesson 10's {LESSON10 / 'train.py'}, which is missing; run "
             "from a full copy of the course, or leave --pipeline out")
    if args.grad_sync and not (LESSON08 / "train.py").exists():
        fail(f"--grad-sync needs lesson 08's {LESSON08 / 'train.py'}, which is missing; run "
             "from a full copy of the course, or leave --grad-sync out")
    args.allreduce_sizes = [parse_size(s.strip()) for s in args.allreduce_sizes.split(",")
                            if s.strip()]

    if args.max_world_size is None:
        args.max_world_size = gpus if on_gpus else cpu_cores()
    if on_gpus and args.max_world_size > gpus:
        fail(f"--max-world-size {args.max_world_size} needs as many GPUs (one per rank), but "
             f"{gpus} visible; use --max-world-size {gpus} or --device cpu")
    if args.threads_per_worker is None:
        args.threads_per_worker = max(1, cpu_cores() // max(args.max_world_size, 1))
    for name in ("max_world_size", "batch_size", "image_size", "steps", "mlp_steps",
                 "accumulate", "allreduce_iters", "timeout", "threads_per_worker", "repeats",
                 "warmup", "pipeline_layers", "microbatches", "bubble_steps", "pipeline_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if not 0 <= args.simulate_ms < float("inf"):  # nan fails this too
        fail(f"--simulate-ms must be at least 0 (got {args.simulate_ms:g})")
    if args.pipeline and args.batch_size % args.microbatches:
        fail(f"--microbatches {args.microbatches} does not divide --batch-size "
             f"{args.batch_size}: every micro-batch of a pipeline must have the same shape; "
             "choose a --batch-size that is a multiple of --microbatches")
    if "resnet18" in args.models and args.image_size < 32:
        fail(f"--image-size {args.image_size} is too small for ResNet-18's five halvings; "
             "use 32 or more")
    return args


if __name__ == "__main__":
    main(parse_args())
