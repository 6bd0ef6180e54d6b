"""Lesson 07: sharding, for a model whose training state no longer fits on one device.

Lesson 02's program, with the training state split across the ranks instead of copied to each.
DDP keeps a full copy of the parameters, gradients and optimizer state on every rank. ZeRO-1
(--strategy zero1) gives each rank the optimizer state of its share of the parameters; FSDP
(--strategy fsdp, FSDP2's fully_shard) gives each rank 1/N of every parameter, gradient and
optimizer state, and gathers one layer at a time for forward and backward. All three take the
same steps; the run prints the bytes each rank holds. torch.distributed.checkpoint saves each
rank's shards in parallel, and a run resumes from them with any strategy and number of ranks.
mp.spawn starts the ranks on one machine; torchrun, as in lesson 04, on one machine or several.

Run it:
    python 07_sharding/train.py                                  # FSDP on every GPU, or 2 CPU ranks
    python 07_sharding/train.py --strategy zero1 --world-size 4  # ZeRO-1, 4 CPU processes
    python 07_sharding/train.py --strategy ddp --hidden 4096     # DDP on a wider model: more memory
    CUDA_VISIBLE_DEVICES=0,1 python 07_sharding/train.py         # the first two GPUs, NCCL
    torchrun --standalone --nproc-per-node 2 07_sharding/train.py  # torchrun starts the ranks
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        07_sharding/train.py --out-dir /shared/runs/07   # on node 0; node 1: --node-rank 1.
                                                         # --out-dir: a folder every node sees
"""

import argparse
import contextlib
import datetime
import glob
import json
import os
import resource
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------
def choose_backend(requested, world_size, flag="--world-size"):
    """NCCL when every rank can have its own GPU, else gloo on the CPU. flag names what set
    the number of ranks on this machine: --world-size, or torchrun's --nproc-per-node."""
    gpus = torch.cuda.device_count()
    if requested == "nccl":
        if gpus == 0 or not dist.is_nccl_available():
            fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
        if world_size > gpus:
            fail(f"{flag} {world_size} with NCCL needs {world_size} GPUs (one per rank), "
                 f"but {gpus} visible; use {flag} {gpus} or --backend gloo")
        return "nccl"
    if requested == "auto" and 0 < world_size <= gpus and dist.is_nccl_available():
        return "nccl"
    if requested == "auto" and gpus > 0:
        print(f"note: {world_size} ranks but {gpus} GPU(s); NCCL needs one GPU per rank, "
              "so the ranks train on the CPU with gloo")
    return "gloo"


def find_free_port():
    # Port 0 asks the operating system for any free port. Two jobs started at the same moment
    # get different ports, where a fixed default such as 29500 would make the second one fail.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def setup_process_group(rank, local_rank, world_size, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    if backend == "nccl":
        # Pin this process to its own GPU before anything touches CUDA. Without it every rank
        # would open a context on GPU 0, and NCCL would fail with "Duplicate GPU detected".
        # The local rank picks it: under torchrun on several nodes, each numbers its GPUs from 0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # The ranks share the machine's cores: give each its share of threads, or they all
        # start one thread per core and spend their time fighting over them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, cores // ranks_here))
        device = torch.device("cpu")
    # MASTER_ADDR and MASTER_PORT (set by launch or torchrun) tell every rank where rank 0
    # listens. The timeout bounds the wait for the other ranks here, and every collective after
    # it: a rank that never arrives ends the job with an error instead of a silent hang (the
    # default is 10 minutes for NCCL, 30 for gloo).
    dist.init_process_group(backend, store=restart_store(rank, world_size, timeout), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def local_bytes(tensors):
    """Bytes of the tensors as this rank holds them: of a sharded tensor (a DTensor), only the
    shard that lives here (to_local), so the count is exact on any device."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_memory_bytes(device):
    """The most memory this rank has used so far: on a GPU, what PyTorch allocated there; on
    the CPU, the process's peak resident memory (Python and torch's libraries included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def latest_checkpoint(checkpoint_dir):
    """The newest checkpoint folder whose save finished, or None. dcp.save writes .metadata
    last, once every rank's files are complete: a folder without it is a save cut short."""
    finished = sorted(glob.glob(os.path.join(checkpoint_dir, "epoch_*", ".metadata")))
    return os.path.dirname(finished[-1]) if finished else None


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
class WineDataset(Dataset):
    def __init__(self, features, labels):
        self.features = torch.as_tensor(features, dtype=torch.float32)
        self.labels = torch.as_tensor(labels, dtype=torch.long)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.features[index], self.labels[index]


def load_data():
    """The same 142 training and 36 test wines in every lesson."""
    # Imported here rather than at the top: only the ranks load data, so the launching process
    # skips scikit-learn's import (about a second on a laptop) before it starts them.
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    features, labels = load_wine(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.2, random_state=42, stratify=labels
    )
    # Fit the scaler on the training part only: the test wines must not leak into training.
    scaler = StandardScaler().fit(x_train)
    return (
        WineDataset(scaler.transform(x_train), y_train),
        WineDataset(scaler.transform(x_test), y_test),
    )


def prepare_dataloader(dataset, batch_size, seed, rank, world_size):
    # DistributedSampler deals each rank a disjoint slice of a seeded permutation, the same
    # permutation on every rank. If the data does not split evenly it repeats a few samples so
    # that every rank runs the same number of steps (a rank with one step fewer would leave the
    # others waiting forever in the gradient all-reduce). It shuffles, so the DataLoader doesn't.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class WineMLP(nn.Module):
    """13 measurements -> 64 hidden units (--hidden) -> 3 cultivars. The names fc1 and fc2 are
    the checkpoint keys of every lesson, so any lesson's final.pt loads into this class."""

    def __init__(self, in_features=13, hidden=64, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def shard_model(model, strategy, device, world_size):
    """Wrap the model for the strategy: DDP (ddp, zero1) or FSDP2's fully_shard (fsdp)."""
    if strategy != "fsdp":
        # device_ids names the one GPU this rank's model lives on; on the CPU it is left out.
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # The mesh names the ranks that share the model and their device type. Given explicitly,
    # because fully_shard's default mesh is on the accelerator whenever one exists, and it
    # moves the parameters there: a gloo run on a GPU machine would put its CPU model on the
    # GPU (_init_default_mesh in torch/distributed/fsdp/_fully_shard/_fsdp_init.py; reported
    # as a crash in https://github.com/pytorch/pytorch/issues/132471).
    mesh = init_device_mesh(device.type, (world_size,))
    # Each fully_shard call makes one unit: its parameters are cut into world_size slices
    # along dim 0, and each rank keeps one slice (a DTensor). In forward and backward a unit
    # is all-gathered whole, used, and freed again; its gradients are reduce-scattered, so each
    # rank receives the averaged gradient of its own slice only. One unit per layer means a
    # layer or two are whole at a time (the next one's all-gather may already be under way),
    # never the model. The root call takes any parameters no layer took (none here) and runs
    # the units' schedule. Unlike DDP, FSDP does not broadcast rank 0's weights: every rank
    # cuts its slice from the model it built, so the seed before WineMLP() makes them agree.
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build_optimizer(model, strategy, lr):
    if strategy == "zero1":
        # ZeRO stage 1: every rank still holds all parameters and, after DDP's all-reduce, all
        # gradients, but Adam's state (two tensors per parameter) only for its share of the
        # parameters. Each rank steps its share, then broadcasts it to the others. The share
        # is whole tensors, dealt largest first to the rank with the fewest elements so far.
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=lr)
    return torch.optim.Adam(model.parameters(), lr=lr)


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir,
                 rank, world_size, strategy):
        self.model = model
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank = rank
        self.world_size = world_size
        # One flag gates printing and file writes, so N ranks don't print N copies.
        self.is_main_process = rank == 0
        self.strategy = strategy
        # Where training stands: what a checkpoint saves and a resume restores.
        self.checkpoint_dir = os.path.join(out_dir, "checkpoint")
        self.epochs_completed = 0
        self.losses = []

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(features), labels)
        # DDP's backward also all-reduces the gradients and divides them by world_size: the
        # average of the ranks' batch-mean gradients is the gradient of the global batch, so
        # every rank takes the step one process with world_size times the batch would take.
        # FSDP's backward reduce-scatters them instead: the same average, but each rank
        # receives only the slice that matches its slice of the parameters, and steps that.
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def train_epoch(self, epoch):
        self.model.train()
        # Reseed the sampler's shuffle, or every epoch deals the same samples in the same order.
        self.train_loader.sampler.set_epoch(epoch)
        totals = torch.zeros(2, device=self.device)  # [sum of per-sample losses, samples]
        for features, labels in self.train_loader:
            features, labels = features.to(self.device), labels.to(self.device)
            # The loss is a mean over the batch; weight it by the batch size so the epoch's
            # mean is over samples, even when the last batch is smaller.
            totals[0] += self.train_step(features, labels) * len(labels)
            totals[1] += len(labels)
        # Each rank only saw its own slice. Sum the slices' totals over all ranks, so the loss
        # that rank 0 reports is the mean over every sample, not over rank 0's share.
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """Count correct predictions over the whole test set, each wine exactly once."""
        self.model.eval()
        # DistributedSampler would pad the 36 test wines to a multiple of world_size with
        # repeats, and the repeats would be counted twice. A plain stride gives every wine to
        # exactly one rank, some ranks get one fewer, and evaluation needs no lockstep.
        features = self.test_set.features[self.rank::self.world_size].to(self.device)
        labels = self.test_set.labels[self.rank::self.world_size].to(self.device)
        # DDP's wrapped model (.module): evaluation needs none of DDP's synchronisation. FSDP's
        # forward itself gathers each layer from every rank, so every rank must call it, even
        # one whose slice of the test set is empty.
        model = self.model.module if isinstance(self.model, DDP) else self.model
        predictions = model(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return int(counts[0]), int(counts[1])

    def memory_per_rank(self):
        """[parameters, gradients, optimizer state, peak] in bytes, one row per rank."""
        params = list(self.model.parameters())
        # ZeroRedundancyOptimizer keeps its share of Adam's state in a plain Adam, .optim.
        optimizer = self.optimizer.optim if self.strategy == "zero1" else self.optimizer
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        row = torch.tensor([local_bytes(params), local_bytes(p.grad for p in params),
                            local_bytes(state), peak_memory_bytes(self.device)],
                           device=self.device)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row)  # every rank's row, so that rank 0 can print them all
        return [r.tolist() for r in rows]

    def training_state(self):
        """{"model": ..., "optimizer": ...}: tensors by parameter name, each rank's own shards."""
        if self.strategy != "zero1":
            # The same names under every strategy ("fc1.weight", no "module." prefix): what
            # lets a checkpoint written by one strategy load into another.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            return {"model": model_state, "optimizer": optimizer_state["state"]}
        # get_state_dict does not know ZeroRedundancyOptimizer: name its Adam's state here.
        names = {p: name.removeprefix("module.") for name, p in self.model.named_parameters()}
        adam = self.optimizer.optim
        for p in adam.param_groups[0]["params"]:
            if not adam.state[p]:  # Adam creates its state at the first step; make room to load
                adam.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        return {"model": get_model_state_dict(self.model),
                "optimizer": {names[p]: adam.state[p] for p in adam.param_groups[0]["params"]}}

    def save_checkpoint(self):
        path = os.path.join(self.checkpoint_dir, f"epoch_{self.epochs_completed:04d}")
        if self.is_main_process:
            shutil.rmtree(path, ignore_errors=True)  # a save of this epoch that was cut short
            os.makedirs(path)
            with open(os.path.join(path, "progress.json"), "w") as f:
                json.dump({"epochs_completed": self.epochs_completed, "train_loss": self.losses,
                           "strategy": self.strategy, "world_size": self.world_size}, f)
        dist.barrier()  # the folder exists before any rank writes into it
        # Every rank writes the tensors it holds to its own file, all at once; a tensor that
        # several ranks hold whole is written by one of them. Rank 0 then writes .metadata:
        # each tensor's global shape and which file holds which chunk of it.
        dcp.save(self.training_state(), checkpoint_id=path)
        if self.is_main_process:  # this save is complete: older ones can go
            for old in glob.glob(os.path.join(self.checkpoint_dir, "epoch_*")):
                if old != path:
                    shutil.rmtree(old)

    def load_checkpoint(self, path):
        with open(os.path.join(path, "progress.json")) as f:
            progress = json.load(f)
        # Each rank reads, from whichever files hold them, exactly the pieces of each tensor it
        # needs now: the checkpoint loads whatever strategy and number of ranks wrote it.
        state = self.training_state()
        dcp.load(state, checkpoint_id=path)
        if self.strategy == "zero1":  # the loaded Adam state is already in place
            set_model_state_dict(self.model, state["model"])
        else:
            _, optimizer_state = get_state_dict(self.model, self.optimizer)
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict={**optimizer_state, "state": state["optimizer"]})
        self.epochs_completed = progress["epochs_completed"]
        self.losses = list(progress["train_loss"])
        return progress

    def train(self, max_epochs):
        # From the checkpoint's next epoch, not from 0: no epoch is repeated or skipped.
        for epoch in range(self.epochs_completed, max_epochs):
            start = time.perf_counter()
            loss = self.train_epoch(epoch)
            self.losses.append(loss)
            self.epochs_completed = epoch + 1
            if self.is_main_process:
                print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                      f"| {time.perf_counter() - start:.3f} s", flush=True)
            if self.epochs_completed % self.save_every == 0 or self.epochs_completed == max_epochs:
                self.save_checkpoint()  # every rank: each holds shards that no other has
        return self.losses


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, local_rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, local_rank, args.world_size, args.backend, args.timeout)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, rank,
                                      args.world_size)

    # Seed before building the model so the initial weights are the same on every rank.
    # (DDP also copies rank 0's weights to the others when it wraps the model.)
    torch.manual_seed(args.seed)
    model = WineMLP(hidden=args.hidden).to(device)
    model = shard_model(model, args.strategy, device, args.world_size)
    optimizer = build_optimizer(model, args.strategy, args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, rank, args.world_size, args.strategy)

    # Automatic resume: a finished checkpoint in --out-dir means an earlier run got this far.
    # Rank 0 picks it and tells the others, so that every rank loads the same one; every rank
    # reads its shards from that folder, so it must see it too, also on another node (see
    # agree_on_checkpoint in the guard rails).
    checkpoint = agree_on_checkpoint(rank, trainer.checkpoint_dir)
    if checkpoint:
        progress = trainer.load_checkpoint(checkpoint)
        if trainer.is_main_process:
            print(f"resuming from {checkpoint}: {trainer.epochs_completed} of {args.epochs} "
                  f"epochs done, written by {progress['strategy']} on "
                  f"{progress['world_size']} ranks, loaded by {args.strategy} on "
                  f"{args.world_size}", flush=True)
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}, "
              f"{args.strategy}): {len(train_set)} train / {len(test_set)} test wines, batch "
              f"{args.batch_size} per rank ({args.batch_size * args.world_size} in all)",
              flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    memory = trainer.memory_per_rank()  # before evaluating, which gathers layers again
    correct, total = trainer.evaluate()
    # The full, plain weights: gathered from every rank's shards (a collective, so every rank
    # takes part), onto rank 0's CPU alone. They load into lesson 01's model.
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    if not trainer.is_main_process:
        return  # rank 0 holds every result now; it alone writes them

    torch.save(weights, os.path.join(args.out_dir, "final.pt"))
    print(f"memory per rank ({args.strategy}, {args.world_size} ranks, hidden {args.hidden}), "
          "bytes held after the last step:", flush=True)
    print(f"{'rank':>4} {'parameters':>12} {'gradients':>12} {'optimizer':>12} "
          f"{'peak':>12}", flush=True)
    for r, row in enumerate(memory):
        print(f"{r:>4} " + " ".join(f"{n:>12,}" for n in row), flush=True)
    metrics = {
        "lesson": "07_sharding",
        "strategy": args.strategy,
        "hidden": args.hidden,
        "world_size": args.world_size,
        "launcher": args.launcher,
        "resumed_after_epoch": progress["epochs_completed"] if checkpoint else 0,
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "threads_per_rank": torch.get_num_threads(),
        "train_loss": losses,
        "test_correct": correct,
        "test_total": total,
        "test_accuracy": correct / total,
        "train_seconds": train_seconds,
        "wall_seconds": time.time() - start,
        # Per rank, in bytes. peak: torch.cuda.max_memory_allocated on a GPU, the process's
        # peak resident memory (ru_maxrss) on the CPU.
        "memory": [dict(zip(("parameters", "gradients", "optimizer_state", "peak"), row,
                            strict=True)) for row in memory],
        "peak_memory_measure": "cuda_max_allocated" if device.type == "cuda" else "max_rss",
    }
    with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


def worker(local_rank, args):
    """What each process runs, started by mp.spawn or torchrun: main, then leave the group."""
    # mp.spawn on one machine: the local rank is the global rank. torchrun says which it is.
    rank = int(os.environ["RANK"]) if args.launcher == "torchrun" else local_rank
    with rank_guard(rank, args):  # a failure becomes one line; see the guard rails below
        main(rank, local_rank, args)
        dist.destroy_process_group()


def launch(args):
    """Pick backend and port, then start one process per rank; or, under torchrun, which has
    started them already, be one rank."""
    args.start_time = time.time()
    if started_by_torchrun():
        # torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: this process
        # is one rank. The ranks of every node form one group, one mesh, one checkpoint.
        args.launcher = "torchrun"
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        check_sharding(args)
        worker(int(os.environ["LOCAL_RANK"]), args)  # runs main, then ends this process
        return
    args.launcher = "spawn"
    args.backend = choose_backend(args.backend, args.world_size)
    check_sharding(args)  # the width and any checkpoint: see the guard rails
    # Every rank connects to rank 0 at MASTER_ADDR:MASTER_PORT. On one machine that is the
    # loopback address; a port set in the environment wins, else any free one.
    check_master_port()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"starting {args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # spawn starts world_size fresh Python processes and calls worker(rank, args) in each,
    # with rank = 0 .. world_size - 1. If one fails, spawn stops the others and raises.
    with spawn_guard("rank", then=". Run the same command again to resume from the last "
                     "checkpoint"):
        mp.spawn(worker, args=(args,), nprocs=args.world_size)


# =============================================================================================
# Guard rails: what turns a mistake into one line that names the fix, instead of a traceback or
# a hang. The lesson is above; this section is worded the same in every lesson.
# =============================================================================================
def fail(message):
    """Stop with one line that says what is wrong and how to fix it (no traceback)."""
    sys.exit(f"error: {message}")


def check_args(args):
    """Refuse a value that cannot work, naming its flag (a flag the lesson lacks is skipped)."""
    for name in ("epochs", "batch_size", "save_every", "world_size", "nnodes", "nproc_per_node",
                 "crash_at_epoch"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    for name in ("lr", "timeout"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            fail(f"--{name} must be positive (got {value:g})")
    return args


def started_by_torchrun():
    # torchrun sets TORCHELASTIC_RUN_ID, with RANK, LOCAL_RANK and WORLD_SIZE, in every process
    # it starts.
    return "TORCHELASTIC_RUN_ID" in os.environ


def check_launcher(torchrun_ok):
    """Name the right command when a launcher the lesson is not written for started it."""
    if started_by_torchrun() and not torchrun_ok:
        fail(f"{sys.argv[0]} is not written for torchrun, which starts only lessons 03, 04, 05 "
             f"and 07; start it with: python {sys.argv[0]}")


def check_out_dir(path):
    """--out-dir must be a folder this process can write to, or become one."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"--out-dir {path} is a file, not a folder; choose another --out-dir")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        fail(f"--out-dir {path} cannot be created ({error.strerror}); choose another --out-dir")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"--out-dir {path} is not writable by this user; choose another --out-dir")


def start(entry, parse, torchrun_ok):
    """Check how the lesson was started, its flags and where it writes, then run entry(args)."""
    try:
        check_launcher(torchrun_ok)
        args = parse()
        check_out_dir(args.out_dir)
        entry(args)
    except SystemExit as stop:
        # torchrun runs one copy per rank, and each would print the same line: rank 0 says it.
        if started_by_torchrun() and os.environ.get("RANK") != "0" and stop.code:
            sys.exit(1)
        raise
    except KeyboardInterrupt:
        # Ctrl-C: one line instead of the traceback of wherever the program happened to be.
        # The terminal sent it to the ranks too, and they stop; any still running is stopped
        # here, so that none is left behind.
        for child in mp.active_children():
            child.terminate()
            child.join(timeout=10)
        if not started_by_torchrun() or os.environ.get("RANK") == "0":
            print("error: interrupted (Ctrl-C); the run stopped before it finished",
                  file=sys.stderr)
        sys.exit(130)


def port_in_use(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR, as the rendezvous server itself sets it: a port that only lingers in
        # TIME_WAIT after an earlier run is free; one that a live server listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def check_master_port():
    """A MASTER_PORT set in the environment must be a port number that nothing listens on."""
    port = os.environ.get("MASTER_PORT")
    if port is None:
        return
    if not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"MASTER_PORT={port} is not a port number; unset it to use a free port")
    if port_in_use(int(port)):
        fail(f"MASTER_PORT={port} is already in use on this machine; choose another "
             "(export MASTER_PORT=29501) or unset it to use a free port")


@contextlib.contextmanager
def rank_guard(rank, args, meet_fix="raise --timeout if this machine is very busy",
               lost_fix="another rank stopped, or stalled longer than --timeout; its output "
                        "says which"):
    """Around one rank's work: ranks that do not meet, or lose each other, end with one line
    each, and Ctrl-C quietly; the rank leaves the process group however it ends, and its
    process through leave_process, except for a failure of its own under mp.spawn, which goes
    on up to spawn (spawn shows its traceback and names the rank)."""
    code = 0
    try:
        yield
    except KeyboardInterrupt:
        code = 130  # Ctrl-C reached every process: the launcher says so, once
    except SystemExit as stop:
        # This rank stopped with its own line (sys.exit), which Python would print on its way
        # out: printed here instead (under torchrun, rank 0's alone, as start() does).
        code = 1 if isinstance(stop.code, str) else stop.code or 0
        if isinstance(stop.code, str) and not (started_by_torchrun() and rank != 0):
            print(stop.code, file=sys.stderr)
    except Exception as error:
        code = 1
        if is_lost_contact(error):
            # Printed here, not by fail(): each rank has its own story, and under torchrun
            # start() keeps only rank 0's copy of the lines that every rank shares.
            print(f"error: {lost_contact_line(error, rank, args, meet_fix, lost_fix)}",
                  file=sys.stderr)
        elif started_by_torchrun():
            # This rank's own failure, with its traceback as Python would print it on its way
            # out (torch puts [rankN] before each line); then the rank leaves with exit code 1.
            sys.excepthook(type(error), error, error.__traceback__)
        else:
            raise  # this rank's own failure: spawn shows its traceback and names the rank
    finally:
        # Also when training fails, so this rank does not leave its peers hanging.
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_process(code)  # the work ended well (0), or with its one line (1) or Ctrl-C (130)


def lost_contact_line(error, rank, args, meet_fix, lost_fix):
    """What a rank that lost the others says: gloo's or the store's first line, without its
    source location and advice, and what to do."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    reason = reason.split("] ", 1)[-1].split(". ")[0][:160]
    if not dist.is_initialized():
        return (f"rank {rank}: not all {args.world_size} ranks met at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within "
                f"{args.timeout:g} s ({reason}); {meet_fix}")
    return f"rank {rank} lost contact with the other ranks ({reason}); {lost_fix}"


def leave_process(code=0):
    """The teardown workaround: a rank whose work is done and written, or that has said why it
    stopped, leaves at once with that exit code.

    With torch 2.14, gloo's threads can outlive destroy_process_group, and Python tearing down
    the interpreter under them sometimes aborts the rank ("terminate called without an active
    exception"): a job whose results are on disk fails, and a rank that printed its one-line
    error or its traceback dies with exit code -6, so the launcher adds a second, wrong line
    (torchrun: "Signal 6 (SIGABRT)"). Seen in lesson 07 (ZeRO-1) about 1 run in 25, after "lost
    contact" in lesson 03, and in about 1 torchrun run in 10 where a rank raised;
    `python tools/repro_teardown.py --lesson 07_sharding` counts it with and without this
    function, and with --crash for a rank that raises under torchrun. Upstream:
    pytorch/pytorch#190489 and the abandoned pytorch/pytorch#179291 (gloo work that outlives
    the interpreter)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_lost_contact(error):
    """Whether error says that the other ranks did not come, went away or stalled: the store's
    and the network's errors, or a backend's (gloo, NCCL) whose text says so. Any other backend
    error, such as NCCL's "Duplicate GPU detected", is this rank's own and keeps its traceback.
    In backward, autograd hands on gloo's error as a plain RuntimeError, hence the look at the
    text."""
    if isinstance(error, (dist.DistStoreError, dist.DistNetworkError)):
        return True
    signs = ("connection reset by peer", "connection closed by peer", "connection refused",
             "timed out", "timeout", "broken pipe", "remote process exited", "network error")
    return isinstance(error, RuntimeError) and any(sign in str(error).lower() for sign in signs)


@contextlib.contextmanager
def spawn_guard(what, then=""):
    """Around mp.spawn: a rank that fails or dies becomes one line naming it (not a traceback
    of spawn's), and the job ends; spawn has already stopped the other ranks."""
    try:
        yield
    except mp.ProcessRaisedException as error:
        print(error, file=sys.stderr)
        fail(f"{what} {error.error_index} failed (its traceback is above); the other {what}s "
             f"were stopped{then}")
    except mp.ProcessExitedException as error:
        if error.exit_code == 130:
            raise KeyboardInterrupt from None  # a rank stopped by Ctrl-C
        if error.exit_code == 1:
            sys.exit(1)  # the rank stopped with its own one-line error, printed above
        fail(f"{what} {error.error_index} died with exit code {error.exit_code} (killed, or out "
             f"of memory?); the other {what}s were stopped{then}")


# ---------------------------------------------------------------------------------------------
# Guard rails of this lesson: a width or a checkpoint that cannot continue this run, a checkpoint
# folder that some rank cannot see, and the store torchrun's restarts need
# ---------------------------------------------------------------------------------------------
def check_sharding(args):
    """Refuse, before any rank starts, a width or a checkpoint that cannot work."""
    if args.hidden < 1:
        fail(f"--hidden must be at least 1 (got {args.hidden})")
    checkpoint = latest_checkpoint(os.path.join(args.out_dir, "checkpoint"))
    if checkpoint:
        check_checkpoint(checkpoint, args)


def check_checkpoint(path, args):
    """Stop with one line if the checkpoint in path cannot go on as this run asks."""
    try:
        # DCP's .metadata is a pickle, read with pickle.load (not weights_only): resume only
        # from checkpoints you or your job wrote. The shards themselves load weights_only.
        metadata = dcp.FileSystemReader(path).read_metadata()
        with open(os.path.join(path, "progress.json")) as f:
            done = json.load(f)["epochs_completed"]
        hidden = metadata.state_dict_metadata["model.fc1.weight"].size[0]
    except Exception as error:  # a damaged folder raises one of several types
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        fail(f"{path} cannot be loaded ({type(error).__name__}: {reason[:150]}); it is damaged "
             "or not a checkpoint of this lesson: delete it or choose another --out-dir")
    if hidden != args.hidden:
        fail(f"{path} holds a model with --hidden {hidden}, not {args.hidden}; resume with "
             f"--hidden {hidden}, or delete it or choose another --out-dir")
    if done > args.epochs:
        fail(f"{path} has {done} epochs done, more than --epochs {args.epochs}; ask for at "
             f"least {done} or choose another --out-dir")


def agree_on_checkpoint(rank, checkpoint_dir):
    """The checkpoint to resume from (None: start afresh), chosen by rank 0 for every rank,
    once every rank has shown that it sees the folder rank 0 writes to. Else one line from
    rank 0, and the job stops before it trains.

    Every rank writes its own shards into that folder and reads them all back on resume. On
    one machine it is one folder; across nodes it is one only on a filesystem they share. On
    disks of their own, each node would keep its ranks' shards and rank 0 alone .metadata: a
    checkpoint that no node could load, found only at the resume."""
    note = os.path.join(checkpoint_dir, ".rank0")
    choice = [None, None]  # [checkpoint or None, what rank 0 wrote into the note]
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        choice = [latest_checkpoint(checkpoint_dir), f"{socket.gethostname()} {time.time_ns()}"]
        with open(note, "w") as f:
            f.write(choice[1])
    dist.broadcast_object_list(choice, src=0)  # after the write: the others look only now
    try:
        with open(note) as f:
            sees = f.read() == choice[1]
    except OSError:
        sees = False
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), sees))
    if rank == 0:
        os.remove(note)
    blind = [f"rank {r} (host {host})" for r, (host, sees) in enumerate(views) if not sees]
    if blind:
        sys.exit(f"error: {', '.join(blind)} cannot see {checkpoint_dir}, where rank 0 writes; "
                 "every rank writes its shards of the checkpoint there and reads them back, so "
                 "give every node the same --out-dir on a filesystem they all share"
                 if rank == 0 else 1)
    return choice[0]


def restart_store(rank, world_size, timeout):
    """None (init_process_group builds the store from MASTER_ADDR and MASTER_PORT), except in a
    torchrun restart that shares its agent's store: then that store, with a prefix per attempt.

    torchrun's agent hosts one store for the whole job, across restarts (--standalone and the
    c10d rendezvous, torch 2.4 to 2.14), and hands it to every attempt. The ranks of a
    restarted attempt would find the keys of the failed one in it, such as the addresses of
    ranks that are gone, and fail ("Connection refused") or hang. A prefix per attempt keeps
    each attempt's keys its own. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's
    environment, PyTorch's own switch, every attempt gets a fresh store and this returns None.
    On several nodes with the c10d rendezvous only the switch works: torchrun also restarts a
    node's ranks when another node's failed, without counting it, so the nodes' counts and
    prefixes can differ, and the restarted ranks wait --timeout for each other; rank 0 says so
    when such a job starts. tools/repro_agent_store.py reproduces both (--nodes 2); upstream:
    pytorch/pytorch#135712."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if (shared and nodes > 1 and attempt == 0 and rank == 0
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        print(f"note: torchrun may restart these ranks on {nodes} nodes, with one store for "
              "every attempt; with the c10d rendezvous, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
              "for torchrun on every node, or a restart can wait --timeout for ranks that never "
              "come (pytorch/pytorch#135712)", flush=True)
    if attempt == 0 or not shared:
        return None
    return dist.PrefixStore(
        f"attempt_{attempt}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                      is_master=False, timeout=datetime.timedelta(seconds=timeout)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 07: train the wine MLP with DDP, ZeRO-1 or FSDP (mp.spawn or "
                    "torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default="runs/07_sharding",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--world-size", type=int,
                        default=torch.cuda.device_count() or 2,
                        help="number of processes (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others (to start, or in any "
                             "collective) before giving up with an error")
    parser.add_argument("--strategy", default="fsdp", choices=["ddp", "zero1", "fsdp"],
                        help="ddp: everything on every rank; zero1: the optimizer state "
                        "sharded; fsdp: parameters, gradients and optimizer state sharded")
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden units; 64 is lesson 01's model, thousands show memory")
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
