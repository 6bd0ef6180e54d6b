"""Lesson 09: tensor parallelism, for layers too large for one device, and 2-D with FSDP.

Lesson 07's program, with each layer itself split across ranks (Megatron-LM's tensor
parallelism), the idea that tensor_parallel.py holds (read it first): fc1's output columns dealt
out over --tp ranks, fc2's input rows likewise, so each rank multiplies its own slice and one
all-reduce puts fc2's output together. The ranks of a TP group read the same batches; --dp M
groups of them train as data parallel, FSDP across the "dp" dimension of an M x N device mesh. TP
alone takes one process's steps; 2-D takes DDP's steps on M ranks. The checkpoint is lesson 07's,
sharded both ways, and loads into any --dp and --tp.

Run it (each run its own --out-dir, or it resumes the finished checkpoint of the one before):
    python 09_tensor_parallel/train.py                                   # TP on 2 ranks
    python 09_tensor_parallel/train.py --dp 2 --tp 2 --out-dir runs/09_2d  # 2-D on 4 ranks
    python 09_tensor_parallel/train.py --layers 3 --out-dir runs/09_deep    # two pairs of layers
    torchrun --standalone --nproc-per-node 4 09_tensor_parallel/train.py --tp 2 --out-dir runs/09_tr
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        09_tensor_parallel/train.py --tp 4 --out-dir /shared/runs/09   # node 1: --node-rank 1
"""

import argparse
import contextlib
import datetime
import glob
import json
import os
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
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from guard_rails import (
    agree_on_checkpoint,
    check_args,
    check_backends_agree,
    check_master_port,
    check_sharding,
    check_tensor_parallel,
    fail,
    rank_guard,
    restart_store,
    sharded_save_or_fail,
    spawn_guard,
    start,
    started_by_torchrun,
)
from tensor_parallel import (
    build_mesh,
    count_collectives,
    print_collectives,
    show_who_reads_what,
    split_model,
)


# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------
def choose_backend(requested, world_size, flag="--world-size"):
    """NCCL when every rank can have its own GPU, else gloo on the CPU."""
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
    if requested == "auto" and gpus > 0 and os.environ.get("RANK", "0") == "0":  # torchrun: once
        print(f"note: {world_size} ranks but {gpus} GPU(s); NCCL needs one GPU per rank, "
              "so the ranks train on the CPU with gloo")
    return "gloo"


def find_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))  # port 0: the OS picks a free one, so two jobs never both take 29500
        return sock.getsockname()[1]


def start_ranks(fn, args, nprocs):
    """mp.spawn(fn, args, nprocs), each rank forked from a server that has imported torch and
    scikit-learn once, not a fresh Python that imports them again (lesson 02's README)."""
    if sys.platform != "linux":  # macOS and Windows: spawn, Python's default there
        return mp.spawn(fn, args=args, nprocs=nprocs)
    # torch._dynamo: constructing DDP imports it (1.3 s); sklearn's modules load the wine data.
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "sklearn.datasets",
                               "sklearn.model_selection", "sklearn.preprocessing"])
    return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def setup_process_group(rank, local_rank, world_size, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    if backend == "nccl":
        # Pin each rank to its own GPU before anything touches CUDA, or all of them use GPU 0.
        # The local rank picks it: under torchrun on several nodes, each numbers its GPUs from 0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # The ranks share the cores: each gets its share of threads, or they fight over them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # Under torchrun, LOCAL_WORLD_SIZE of them share this machine (only torchrun's counts).
        ranks_here = int(os.environ["LOCAL_WORLD_SIZE"]) if started_by_torchrun() else world_size
        torch.set_num_threads(max(1, cores // ranks_here))
        device = torch.device("cpu")
    # Meet rank 0 at MASTER_ADDR:MASTER_PORT; timeout bounds this wait and every collective after.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            store=restart_store(rank, world_size, timeout),  # torchrun restarts
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def local_bytes(tensors):
    """Bytes of the tensors as this rank holds them: of a sharded one (a DTensor), its shard."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_baseline(device):
    """Reset the GPU's peak and return what it holds, for peak_memory_bytes to subtract."""
    if device.type != "cuda":
        return 0
    # cuBLAS keeps megabytes of workspace for each thread that multiplies (backward has its own):
    # made now, they stay out of the peak (torch/testing/_internal/common_utils.py skips them too).
    WineMLP().to(device)(torch.zeros(2, 13, device=device)).sum().backward()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_memory_bytes(device, baseline):
    """This rank's peak: on a GPU, allocated since memory_baseline; on the CPU, resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - baseline
    if sys.platform == "win32":
        return -1  # Windows has no getrusage: the table says n/a
    import resource  # Unix and macOS only: imported here, so the lesson starts on Windows

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def save_atomically(obj, path):
    # Write to a temporary file in the same folder, then rename it over the target: a crash in
    # the middle of the write leaves the previous file intact instead of a half-written one.
    from guard_rails import save_or_fail  # a failed write (a full disk): one line, not a traceback

    tmp_path = f"{path}.tmp"
    with save_or_fail(path, tmp_path):
        with open(tmp_path, "wb") as f:
            if path.endswith(".json"):  # metrics.json: text, for people and plotting tools
                f.write(json.dumps(obj, indent=2).encode())
            else:
                torch.save(obj, f)
        os.replace(tmp_path, path)


def latest_checkpoint(checkpoint_dir):
    """The newest finished checkpoint folder, or None: a save writes checksums.json last of all,
    after dcp.save's .metadata (guard_rails.py, record_checksums)."""
    finished = sorted(glob.glob(os.path.join(checkpoint_dir, "epoch_*", "checksums.json")))
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
    # Imported here, where it is used: from lesson 02 on, the process that starts the ranks
    # loads no data, and so skips scikit-learn's import (about a second on a laptop).
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
    # Each rank gets a disjoint slice of one seeded shuffle, padded with repeats so that all
    # run the same number of steps (one step fewer would leave the others waiting forever).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class WineMLP(nn.Module):
    """13 measurements -> 64 hidden units -> 3 cultivars. The names fc1 and fc2 are the
    checkpoint keys of every lesson, so any lesson's final.pt loads into this class.

    layers > 1 puts hidden x hidden layers between fc1 and fc2 (lesson 08's deeper MLP)."""

    def __init__(self, in_features=13, hidden=64, classes=3, layers=1):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers - 1))
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.fc2(x)


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir,
                 rank, world_size, mesh):
        self.model = model
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank = rank
        self.world_size = world_size
        self.is_main_process = rank == 0  # gates printing and writing: one copy, not N
        self.mesh = mesh
        self.dp_group = mesh["dp"].get_group()  # the ranks that read different batches
        self.collectives = None  # {"forward": {kind: count}, "backward": ...} of the first step
        # Where training stands: what a checkpoint saves and a resume restores.
        self.checkpoint_dir = os.path.join(out_dir, "checkpoint")
        self.epochs_completed = 0
        self.losses = []

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        # The run's first step counts its collectives, forward and backward apart.
        first = self.collectives is None
        with CommDebugMode() if first else contextlib.nullcontext() as forward:
            # TP: every rank of a TP group computes fc2's whole output, the logits, after one
            # all-reduce of the partial sums, and so the same loss as one process would.
            loss = F.cross_entropy(self.model(features), labels)
        with CommDebugMode() if first else contextlib.nullcontext() as backward:
            # Backward runs the pairs in reverse: a column-wise layer's input gradient is again a
            # partial sum per rank, all-reduced (not fc1's: its input, the data, needs none).
            # FSDP then reduce-scatters each slice's gradient over "dp": the TP groups' mean.
            loss.backward()
        if first:
            self.collectives = {"forward": count_collectives(forward),
                                "backward": count_collectives(backward)}
        self.optimizer.step()
        return loss.detach()

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)  # else every epoch has the same order
        totals = torch.zeros(2, device=self.device)  # [sum of per-sample losses, samples]
        for features, labels in self.train_loader:
            features, labels = features.to(self.device), labels.to(self.device)
            # The loss is a mean over the batch; weight it by the batch size so the epoch's
            # mean is over samples, even when the last batch is smaller.
            totals[0] += self.train_step(features, labels) * len(labels)
            totals[1] += len(labels)
        # The ranks of a TP group read the same batches: count each batch once, over "dp".
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.dp_group)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """Count correct predictions over the whole test set."""
        self.model.eval()
        # A stride over the TP groups (by dp rank): each test wine in exactly one, whose ranks all
        # compute it together. Every rank calls the model, even with no test wines: TP's
        # all-reduces and FSDP's all-gathers need every rank of their groups.
        dp_rank, dp = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        features = self.test_set.features[dp_rank::dp].to(self.device)
        labels = self.test_set.labels[dp_rank::dp].to(self.device)
        predictions = self.model(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.dp_group)
        return int(counts[0]), int(counts[1])

    def memory_per_rank(self, baseline):
        """[parameters, gradients, optimizer state, peak] in bytes, one row per rank."""
        params = list(self.model.parameters())
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        row = torch.tensor([local_bytes(params), local_bytes(p.grad for p in params),
                            local_bytes(state), peak_memory_bytes(self.device, baseline)],
                           device=self.device)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row)  # every rank's row, so that rank 0 can print them all
        return [r.tolist() for r in rows]

    def training_state(self):
        """{"model": ..., "optimizer": ...}: tensors by parameter name, each rank's own shards."""
        # The same names in every layout ("fc1.weight"): a checkpoint loads into another --tp.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state["state"]}

    def save_checkpoint(self):
        path = os.path.join(self.checkpoint_dir, f"epoch_{self.epochs_completed:04d}")
        with sharded_save_or_fail(self.rank, path) as barrier:  # a failed write: one line
            if self.is_main_process:
                shutil.rmtree(path, ignore_errors=True)  # a save of this epoch that was cut short
                os.makedirs(path)
                with open(os.path.join(path, "progress.json"), "w") as f:
                    json.dump({"epochs_completed": self.epochs_completed, "train_loss": self.losses,
                               "dp": self.mesh["dp"].size(), "tp": self.mesh["tp"].size()}, f)
            barrier()  # the folder exists before any rank writes into it
            # Every rank writes what it holds to its own file, all at once (a tensor held whole
            # by several, once); rank 0 then writes .metadata: which file holds which chunk of what.
            dcp.save(self.training_state(), checkpoint_id=path)
        if self.is_main_process:  # this save is complete: older ones can go
            for old in glob.glob(os.path.join(self.checkpoint_dir, "epoch_*")):
                if old != path:
                    shutil.rmtree(old)

    def load_checkpoint(self, path):
        with open(os.path.join(path, "progress.json")) as f:
            progress = json.load(f)
        # Each rank reads, from whichever files hold them, exactly the pieces of each tensor it
        # needs now: the checkpoint loads whatever --dp and --tp wrote it.
        state = self.training_state()
        dcp.load(state, checkpoint_id=path)
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
    device = setup_process_group(rank, local_rank, args.world_size, args.backend, args.timeout)
    baseline = memory_baseline(device)  # before the model, so the peak covers all of training
    train_set, test_set = load_data()
    mesh = build_mesh(args.dp, args.tp, device, args.timeout)
    train_loader = loader_per_tp_group(train_set, mesh, rank, args)

    # Seed before building the model so the initial weights are the same on every rank.
    torch.manual_seed(args.seed)
    model = WineMLP(hidden=args.hidden, layers=args.layers).to(device)
    model = split_model(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, rank, args.world_size, mesh)
    resumed_after_epoch = resume(trainer, rank, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): --dp {args.dp} "
              f"x --tp {args.tp}, {len(train_set)} train / {len(test_set)} test wines, batch "
              f"{args.batch_size} per TP group ({args.batch_size * args.dp} in all)", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    # Before evaluating, which gathers layers again; a run that took no step has nothing to show.
    memory = trainer.memory_per_rank(baseline) if resumed_after_epoch < args.epochs else []
    correct, total = trainer.evaluate()
    weights = gathered_weights(model)  # a collective: every rank takes part
    if not trainer.is_main_process:
        return  # rank 0 holds every result now; it alone writes them

    save_atomically(weights, os.path.join(args.out_dir, "final.pt"))
    print_collectives(trainer.collectives, args)
    print_memory(memory, f"--dp {args.dp} --tp {args.tp}, hidden {args.hidden}")
    results = {"collectives_first_step": trainer.collectives, "train_loss": losses,
               "test_correct": correct, "test_total": total, "test_accuracy": correct / total,
               "train_seconds": train_seconds, "wall_seconds": time.time() - args.start_time,
               "memory": memory_rows(memory)}
    save_atomically(describe_run(args, device, resumed_after_epoch) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


def loader_per_tp_group(train_set, mesh, rank, args):
    """The sampler deals batches to the TP groups (by dp rank), not to the ranks: a TP group's
    ranks each compute a slice of the same samples, so they must read the same ones."""
    dp_rank = mesh["dp"].get_local_rank()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, dp_rank, args.dp)
    show_who_reads_what(rank, mesh, train_loader)
    return train_loader


def resume(trainer, rank, args):
    """Load the newest finished checkpoint in --out-dir, if any; return the epochs it holds."""
    # Automatic resume: a finished checkpoint in --out-dir means an earlier run got this far.
    # Rank 0 picks it for every rank, once each has shown it sees the folder (guard_rails.py).
    checkpoint = agree_on_checkpoint(rank, trainer.checkpoint_dir, latest_checkpoint)
    if checkpoint:
        progress = trainer.load_checkpoint(checkpoint)
        if trainer.is_main_process:
            print(f"resuming from {checkpoint}: {trainer.epochs_completed} of {args.epochs} "
                  f"epochs done, written by --dp {progress['dp']} --tp {progress['tp']}, "
                  f"loaded by --dp {args.dp} --tp {args.tp}", flush=True)
    if trainer.epochs_completed == args.epochs and trainer.is_main_process:
        print(f"note: {checkpoint} already holds all {args.epochs} epochs: nothing left to "
              "train; raise --epochs to train on, or choose another --out-dir to start afresh",
              flush=True)
    return trainer.epochs_completed


def gathered_weights(model):
    """The full, plain weights: gathered from every rank's shards (a collective, so every rank
    takes part), onto rank 0's CPU alone. They load into lesson 01's model."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def print_memory(memory, layout):
    """Rank 0's table of the bytes each rank held after the last step (none: no step taken)."""
    if not memory:
        return
    print(f"memory per rank ({layout}), bytes held after the last step:", flush=True)
    print(f"{'rank':>4} {'parameters':>12} {'gradients':>12} {'optimizer':>12} "
          f"{'peak':>12}", flush=True)
    for r, row in enumerate(memory):
        print(f"{r:>4} " + " ".join(f"{n:>12,}" if n >= 0 else f"{'n/a':>12}" for n in row),
              flush=True)


def memory_rows(memory):
    """metrics.json's memory: one dict per rank."""
    return [dict(zip(("parameters", "gradients", "optimizer_state", "peak"), row, strict=True))
            for row in memory]


def describe_run(args, device, resumed_after_epoch):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": "09_tensor_parallel",
        "dp": args.dp,
        "tp": args.tp,
        "hidden": args.hidden,
        "layers": args.layers,
        "world_size": args.world_size,
        "launcher": args.launcher,
        "resumed_after_epoch": resumed_after_epoch,
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "threads_per_rank": torch.get_num_threads(),
        "peak_memory_measure": "cuda_max_allocated" if device.type == "cuda" else "max_rss",
    }

def worker(local_rank, args):
    """What each process runs, started by mp.spawn or torchrun: main, then leave the group."""
    # mp.spawn on one machine: the local rank is the global rank. torchrun says which it is.
    rank = int(os.environ["RANK"]) if args.launcher == "torchrun" else local_rank
    with rank_guard(rank, args):  # a failure becomes one line: guard_rails.py
        main(rank, local_rank, args)
        dist.destroy_process_group()


def launch(args):
    """Pick backend and port, then start the ranks; under torchrun, which started them, be one."""
    args.start_time = time.time()
    if started_by_torchrun():
        # torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: this process
        # is one rank. The ranks of every node form one group, one mesh, one checkpoint.
        args.launcher = "torchrun"
        args.world_size = int(os.environ["WORLD_SIZE"])
        check_tensor_parallel(args)  # --dp (default: WORLD_SIZE / --tp) x --tp = WORLD_SIZE
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        check_backends_agree(args.backend, args.timeout)  # every node chose the same one
        check_sharding(args, latest_checkpoint)
        worker(int(os.environ["LOCAL_RANK"]), args)  # runs main, then ends this process
        return
    args.launcher = "spawn"
    check_tensor_parallel(args)  # --tp divides --hidden, --layers pairs up, --dp x --tp ranks
    args.world_size = args.dp * args.tp
    args.backend = choose_backend(args.backend, args.world_size, "--dp x --tp")
    check_sharding(args, latest_checkpoint)  # the width and any checkpoint: see the guard rails
    # Rank 0 listens on this machine: a MASTER_PORT already set wins, else any free port.
    check_master_port()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"starting {args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # Runs worker(rank, args) in world_size new processes, rank 0 .. world_size - 1.
    with spawn_guard("rank", then=". Run it again to resume from the last checkpoint"):
        start_ranks(worker, args=(args,), nprocs=args.world_size)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 09: train the wine MLP with tensor parallelism, and FSDP across it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default="runs/09_tensor_parallel",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--tp", type=int, default=2,
                        help="ranks that split each layer (a TP group)")
    parser.add_argument("--dp", type=int,
                        help="TP groups that read different batches, FSDP across them "
                        "(default: the GPUs, or torchrun's ranks, / --tp; at least 1)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden units; 64 is lesson 01's model, thousands show memory")
    parser.add_argument("--layers", type=int, default=1,
                        help="hidden layers (lesson 08's); odd, so the linear layers pair up")
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
