"""Lesson 06: DDP in practice: mixed precision, gradient accumulation, clipping, torch.compile.

Lesson 02's program, with what every serious DDP script adds: autocast to bf16 or fp16
(--precision), gradient accumulation that all-reduces once per optimizer step (--accumulate,
with no_sync), gradient clipping after the gradients are synchronised (--clip-grad-norm),
torch.compile of the DDP model (--compile), a learning rate scaled to the global batch with a
warm-up (--scale-lr), and, from every rank, the time of each phase of a step, samples/s and
peak memory.

Run it:
    python 06_ddp_in_practice/train.py                                # every GPU, or 2 CPU ranks
    python 06_ddp_in_practice/train.py --precision bf16               # bf16 autocast, CPU or GPU
    python 06_ddp_in_practice/train.py --batch-size 8 --accumulate 4  # 4 micro-batches per step
    python 06_ddp_in_practice/train.py --clip-grad-norm 1 --scale-lr  # clip; lr for global batch
    python 06_ddp_in_practice/train.py --compile                      # needs a C++ compiler
    python 06_ddp_in_practice/train.py --precision fp16               # GPUs: fp16 + GradScaler
"""

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from guard_rails import (
    check_args,
    check_master_port,
    check_practice_args,
    fail,
    rank_guard,
    spawn_guard,
    start,
)


# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------
def choose_backend(requested, world_size):
    """NCCL when every rank can have its own GPU, else gloo on the CPU."""
    gpus = torch.cuda.device_count()
    if requested == "nccl":
        if gpus == 0 or not dist.is_nccl_available():
            fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
        if world_size > gpus:
            fail(f"--world-size {world_size} with NCCL needs {world_size} GPUs (one per rank), "
                 f"but {gpus} visible; use --world-size {gpus} or --backend gloo")
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


def setup_process_group(rank, world_size, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    if backend == "nccl":
        # Pin this process to its own GPU before anything touches CUDA. Without it every rank
        # would open a context on GPU 0, and NCCL would fail with "Duplicate GPU detected".
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        # The ranks share the machine's cores: give each its share of threads, or they all
        # start one thread per core and spend their time fighting over them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // world_size))
        device = torch.device("cpu")
    # MASTER_ADDR and MASTER_PORT (set by launch) tell every rank where rank 0 listens. The
    # timeout bounds the wait for the other ranks here, and every collective after it: a rank
    # that never arrives ends the job with an error instead of a silent hang (the default is
    # 10 minutes for NCCL, 30 for gloo).
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def save_atomically(obj, path):
    # Write to a temporary file in the same folder, then rename it over the target: a crash in
    # the middle of torch.save leaves the previous file intact instead of a half-written one.
    tmp_path = f"{path}.tmp"
    torch.save(obj, tmp_path)
    os.replace(tmp_path, path)


REFERENCE_BATCH = 32  # the batch --lr was chosen for: one process with batch 32, as in lesson 01


def scaled_lr(lr, global_batch):
    """The linear scaling rule (Goyal et al., 2017): k times the batch, k times the lr."""
    return lr * global_batch / REFERENCE_BATCH


def lr_at_step(step, lr, peak_lr, warmup_steps):
    """Warm-up: from lr to peak_lr in a straight line over warmup_steps optimizer steps."""
    if step >= warmup_steps:
        return peak_lr
    return lr + (peak_lr - lr) * step / warmup_steps


def peak_memory_mib(device):
    """The most memory this rank has held: its tensors on a GPU, the whole process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if sys.platform == "win32":
        return None  # Windows has no getrusage
    import resource  # Unix only, hence imported here

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, else KiB


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
    """13 measurements -> 64 hidden units -> 3 cultivars. The names fc1 and fc2 are the
    checkpoint keys of every lesson, so any lesson's final.pt loads into this class."""

    def __init__(self, in_features=13, hidden=64, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir,
                 rank, world_size, accumulate=1, precision="fp32", clip_grad_norm=0.0,
                 lr_schedule=None):
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
        self.accumulate = accumulate
        # Autocast runs each operation in the dtype that suits it: matrix products in bf16 or
        # fp16, reductions such as softmax and the loss in fp32. The weights, their gradients
        # and Adam's state stay fp32 ("master weights"): only the forward's compute changes.
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        # fp16 cannot hold numbers below about 6e-8, so small gradients would become zero. The
        # scaler multiplies the loss before backward, divides the gradients back before the
        # step, and skips a step whose gradients overflowed. bf16 has fp32's range: no scaler.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.clip_grad_norm = clip_grad_norm or math.inf  # inf: measure the norm, clip nothing
        self.lr_schedule = lr_schedule
        self.steps = 0  # optimizer steps taken
        self.grad_norms = []  # the global gradient's norm before clipping, at every step
        self.phase_seconds = dict.fromkeys(("data", "forward", "backward", "optimizer"), 0.0)
        self.epoch_seconds = []

    @contextlib.contextmanager
    def phase(self, name):
        """Add the time spent in the with-block to phase name."""
        # CUDA kernels run asynchronously: wait for them on both sides, or a phase's work would
        # be counted in whichever later phase happens to wait for it.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.phase_seconds[name] += time.perf_counter() - start

    def train_step(self, micro_batches):
        """One optimizer step from up to accumulate micro-batches, with one all-reduce."""
        if self.lr_schedule:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_schedule(self.steps)
        samples = sum(len(labels) for _, labels in micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for i, (features, labels) in enumerate(micro_batches):
            # Inside no_sync, DDP's backward skips the all-reduce and each rank's gradients add
            # up in .grad. The last micro-batch's backward all-reduces the sum: one all-reduce
            # per optimizer step instead of one per micro-batch, and the same result.
            is_last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if is_last else self.model.no_sync():
                with self.phase("forward"), torch.autocast(self.device.type, self.amp_dtype,
                                                           enabled=self.amp_dtype is not None):
                    loss = F.cross_entropy(self.model(features), labels)
                with self.phase("backward"):
                    # Divided by K (weighted by size, so a smaller last micro-batch counts for
                    # less), the summed gradients are those of the mean loss over the step's
                    # samples, as with one batch K times larger. Undivided: K times too large.
                    # DDP's all-reduce then averages over the ranks, as in lesson 02.
                    self.scaler.scale(loss * len(labels) / samples).backward()
            loss_sum += loss.detach().float() * len(labels)
        with self.phase("optimizer"):
            self.scaler.unscale_(self.optimizer)  # fp16: the true gradients, before the norm
            # After the all-reduce: .grad holds the global batch's gradient, the same on every
            # rank, so every rank measures the same norm and clips alike, as one process with
            # the whole batch would. Clipping inside no_sync would clip each rank's own part.
            self.grad_norms.append(nn.utils.clip_grad_norm_(self.model.parameters(),
                                                            self.clip_grad_norm))
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return loss_sum / samples

    def train_epoch(self, epoch):
        self.model.train()
        # Reseed the sampler's shuffle, or every epoch deals the same samples in the same order.
        self.train_loader.sampler.set_epoch(epoch)
        totals = torch.zeros(2, device=self.device)  # [sum of per-sample losses, samples]
        batches = iter(self.train_loader)
        for _ in range(math.ceil(len(self.train_loader) / self.accumulate)):
            with self.phase("data"):
                # The next K micro-batches make one step; the epoch's last step may have fewer.
                micro_batches = [(features.to(self.device), labels.to(self.device))
                                 for features, labels in itertools.islice(batches,
                                                                          self.accumulate)]
            samples = sum(len(labels) for _, labels in micro_batches)
            # The step's loss is a mean over its samples; weight it by their number so the
            # epoch's mean is over samples, even when the last step has fewer.
            totals[0] += self.train_step(micro_batches) * samples
            totals[1] += samples
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
        # The wrapped model (.module): evaluation needs none of DDP's synchronisation.
        predictions = self.model.module(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return int(counts[0]), int(counts[1])

    def save_checkpoint(self, epoch):
        # .module is the plain model inside DDP: its keys have no "module." prefix, so the file
        # loads into lesson 01's model. Every rank holds the same weights; one copy is enough.
        checkpoint = {"model": self.model.module.state_dict(), "epochs_completed": epoch + 1}
        save_atomically(checkpoint, os.path.join(self.out_dir, "checkpoint.pt"))

    def train(self, max_epochs):
        losses = []
        for epoch in range(max_epochs):
            start = time.perf_counter()
            loss = self.train_epoch(epoch)
            losses.append(loss)
            self.epoch_seconds.append(time.perf_counter() - start)
            if self.is_main_process:
                print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                      f"| {self.epoch_seconds[-1]:.3f} s", flush=True)
            if self.is_main_process and (epoch + 1) % self.save_every == 0:
                self.save_checkpoint(epoch)
        return losses

    def measurements(self):
        """Every rank's phase times, peak memory and gradient norms, gathered on every rank."""
        mine = {"rank": self.rank,
                **{f"{name}_seconds": seconds for name, seconds in self.phase_seconds.items()},
                "peak_memory_mib": peak_memory_mib(self.device),
                "grad_norms": torch.stack(self.grad_norms).tolist()}
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        return everyone


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, args.world_size, args.backend, args.timeout)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, rank,
                                      args.world_size)

    # Seed before building the model so the initial weights are the same on every rank.
    # (DDP also copies rank 0's weights to the others when it wraps the model.)
    torch.manual_seed(args.seed)
    model = WineMLP().to(device)
    # device_ids names the one GPU this rank's model lives on; on the CPU it is left out.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        # Compile the DDP model, not the module inside it: torch.compile then splits the graph
        # at DDP's bucket boundaries, so each bucket's all-reduce can start while the rest of
        # backward runs. The first steps pay for the compilation (seconds, even for this MLP).
        model = torch.compile(model)
    # The global batch: what one optimizer step averages over, across ranks and micro-batches.
    global_batch = args.batch_size * args.accumulate * args.world_size
    peak_lr = scaled_lr(args.lr, global_batch) if args.scale_lr else args.lr
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, rank, args.world_size, args.accumulate, args.precision,
                      args.clip_grad_norm,
                      lambda step: lr_at_step(step, args.lr, peak_lr, args.warmup_steps))

    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): "
              f"{len(train_set)} train / {len(test_set)} test wines, batch {args.batch_size} "
              f"per rank x {args.accumulate} micro-batches ({global_batch} per step) | "
              f"{args.precision} | lr {peak_lr:g}", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    correct, total = trainer.evaluate()
    ranks = trainer.measurements()
    if not trainer.is_main_process:
        return  # every rank holds the same results; rank 0 alone writes them

    samples_per_second = args.epochs * len(train_loader.sampler) * args.world_size / train_seconds
    print("rank | data s | forward s | backward+all-reduce s | optimizer s | peak memory MiB")
    for r in ranks:
        memory = "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.0f}"
        print(f"{r['rank']:4d} | {r['data_seconds']:6.3f} | {r['forward_seconds']:9.3f} | "
              f"{r['backward_seconds']:21.3f} | {r['optimizer_seconds']:11.3f} | {memory:>15}")
    print(f"{samples_per_second:.0f} samples/s over all ranks, {trainer.steps} optimizer steps",
          flush=True)

    torch.save(model.module.state_dict(), os.path.join(args.out_dir, "final.pt"))
    metrics = {
        "lesson": "06_ddp_in_practice",
        "world_size": args.world_size,
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "accumulate": args.accumulate,
        "global_batch": global_batch,
        "precision": args.precision,
        "clip_grad_norm": args.clip_grad_norm,
        "compile": args.compile,
        "scale_lr": args.scale_lr,
        "warmup_steps": args.warmup_steps,
        "peak_lr": peak_lr,
        "optimizer_steps": trainer.steps,
        "grad_scale": trainer.scaler.get_scale(),  # fp16's loss scale at the end; else 1
        "seed": args.seed,
        "threads_per_rank": torch.get_num_threads(),
        "train_loss": losses,
        "test_correct": correct,
        "test_total": total,
        "test_accuracy": correct / total,
        "train_seconds": train_seconds,
        "epoch_seconds": trainer.epoch_seconds,
        "samples_per_second": samples_per_second,
        "ranks": ranks,  # per rank: phase seconds, peak memory, gradient norm at every step
        "wall_seconds": time.time() - start,
    }
    with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


def worker(rank, args):
    """What mp.spawn runs in each new process: main, then leave the process group."""
    with rank_guard(rank, args):  # a failure becomes one line: guard_rails.py
        main(rank, args)
        dist.destroy_process_group()


def launch(args):
    """Pick backend and port, then start one process per rank."""
    args.start_time = time.time()
    args.backend = choose_backend(args.backend, args.world_size)
    check_practice_args(args)
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
    with spawn_guard("rank"):
        mp.spawn(worker, args=(args,), nprocs=args.world_size)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 06: DDP in practice: mixed precision, gradient accumulation, "
                    "clipping, torch.compile and the learning rate for the global batch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write checkpoint.pt every N epochs")
    parser.add_argument("--out-dir", default="runs/06_ddp_in_practice",
                        help="folder for checkpoint.pt, final.pt and metrics.json")
    parser.add_argument("--world-size", type=int,
                        default=torch.cuda.device_count() or 2,
                        help="number of processes (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others (to start, or in any "
                             "collective) before giving up with an error")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="autocast dtype of the forward pass; fp16 only on GPUs")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per optimizer step (gradient accumulation)")
    parser.add_argument("--clip-grad-norm", type=float, default=0.0,
                        help="clip the global gradient norm to this (0: measure, do not clip)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--scale-lr", action="store_true",
                        help=f"scale --lr by global batch / {REFERENCE_BATCH} (linear rule)")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="optimizer steps over which the lr rises from --lr to the scaled "
                             "one (with --scale-lr)")
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=False)
