"""Lesson 04: snapshots that survive a crash, and a resume that loses nothing.

Lesson 02's program, made fault tolerant. Every --save-every epochs global rank 0 alone writes
<out-dir>/snapshot.pt: the model, the optimizer's state, the epochs completed and the losses so
far, and the flags that define the run, atomically (a temporary file, flushed, renamed over the
old one), and every rank waits at a barrier until it is on disk. A run whose --out-dir holds a
snapshot continues from it, if its flags match: rank 0 decides, and every rank loads that file
onto its own device (map_location) with weights_only=True and starts at the next epoch. It also
runs under torchrun, which restarts the job after a crash (--max-restarts).

Run it:
    python 04_checkpointing/train.py                               # 2 CPU ranks, or every GPU
    python 04_checkpointing/train.py --save-every 2 --crash-at-epoch 3   # dies at epoch 3 ...
    python 04_checkpointing/train.py --save-every 2                # ... and resumes at epoch 3
    python 04_checkpointing/train.py --world-size 1                # resumes with another size
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 04_checkpointing/train.py \
        --save-every 2 --crash-at-epoch 3 --out-dir runs/04_torchrun  # torchrun restarts it
"""

import argparse
import datetime
import json
import os
import socket
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
    check_snapshot,
    decided_by_rank_0,
    fail,
    rank_guard,
    read_same_snapshot,
    restart_store,
    run_settings,
    spawn_guard,
    start,
    started_by_torchrun,
)


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


def save_atomically(obj, path):
    # Write to a temporary file in the same folder, then rename it over the target: a crash in
    # the middle of torch.save leaves the previous file intact instead of a half-written one.
    # The rename is atomic only within one filesystem, hence the same folder. fsync makes the
    # bytes reach the disk before the rename does, so a power cut cannot leave a renamed but
    # empty file either.
    tmp_path = f"{path}.tmp"
    with open(tmp_path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


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
                 rank, world_size):
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
        # Where training stands: what a snapshot saves and a resume restores.
        self.snapshot_path = os.path.join(out_dir, "snapshot.pt")
        self.epochs_completed = 0
        self.losses = []
        self.crash_at_epoch = None  # set by main from --crash-at-epoch
        self.settings = {}  # set by main: the flags that define the run, saved with it

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(features), labels)
        # DDP's backward also all-reduces the gradients and divides them by world_size: the
        # average of the ranks' batch-mean gradients is the gradient of the global batch, so
        # every rank takes the step one process with world_size times the batch would take.
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
        # The wrapped model (.module): evaluation needs none of DDP's synchronisation.
        predictions = self.model.module(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return int(counts[0]), int(counts[1])

    def save_snapshot(self):
        # Everything the next run needs to go on as if this one had not stopped. .module is the
        # plain model inside DDP: its keys have no "module." prefix, so the weights also load
        # into lesson 01's model. The optimizer's state matters as much: Adam's running means
        # restart from zero without it, and the resumed run would take different steps.
        # Nothing else here draws random numbers: the model is seeded before it is built, and
        # the sampler's order is a function of --seed and the epoch. A model with dropout or
        # random augmentation would also save every rank's torch.get_rng_state().
        snapshot = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epochs_completed": self.epochs_completed,  # also the index of the next epoch
            "train_loss": self.losses,
            "world_size": self.world_size,
            # The flags that define the run: a resume with others would be another run.
            "settings": self.settings,
        }
        save_atomically(snapshot, self.snapshot_path)

    def load_snapshot(self, expected):
        # Every rank loads the same file, so the copies stay identical, as DDP requires.
        # (rank 0 chose it, and every rank checked that it sees that very file).
        snapshot_file = read_same_snapshot(self.snapshot_path, expected)
        # map_location: the tensors were saved from global rank 0's device, so the file says
        # cuda:0. Without it, every rank would load its copy onto cuda:0, crowding that GPU; with
        # it, rank r's copy goes to its own cuda:r (or the CPU). weights_only=True loads tensors
        # and plain containers only: a file that tries to build other objects is refused.
        snapshot = torch.load(snapshot_file, map_location=self.device, weights_only=True)
        self.model.module.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.epochs_completed = snapshot["epochs_completed"]
        self.losses = list(snapshot["train_loss"])
        return snapshot

    def train(self, max_epochs):
        # From the snapshot's next epoch, not from 0: no epoch is repeated or skipped. The
        # sampler is reseeded per epoch (set_epoch), so epoch 3 deals the wines it would have.
        for epoch in range(self.epochs_completed, max_epochs):
            if epoch + 1 == self.crash_at_epoch and self.rank == self.world_size - 1:
                # One rank dies, as when a GPU or a node fails; the launcher stops the others.
                raise RuntimeError(f"simulated crash of rank {self.rank} at the start of epoch "
                                   f"{epoch + 1} (--crash-at-epoch)")
            start = time.perf_counter()
            loss = self.train_epoch(epoch)
            self.losses.append(loss)
            self.epochs_completed = epoch + 1
            if self.is_main_process:
                print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                      f"| {time.perf_counter() - start:.3f} s", flush=True)
            if self.epochs_completed % self.save_every == 0 or self.epochs_completed == max_epochs:
                # Rank 0 alone writes: the ranks hold identical weights, and N ranks writing
                # one file at once (on a shared filesystem, from N nodes) would corrupt it.
                if self.is_main_process:
                    self.save_snapshot()
                # Every rank waits until the snapshot is on disk. Then no rank can read a
                # half-written file, and once any rank is in the next epoch, the snapshot of
                # this one exists: a crash from here on resumes from it.
                dist.barrier()
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
    model = WineMLP().to(device)
    # device_ids names the one GPU this rank's model lives on; on the CPU it is left out.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, rank, args.world_size)
    trainer.settings = run_settings(args)

    # Automatic resume: a snapshot in --out-dir means an earlier run got this far. Rank 0 alone
    # decides whether to resume, and from which epoch, and tells the others: ranks deciding on
    # their own could start at different epochs (a node with no copy, or an old one) and then
    # wait for each other forever. Each rank then loads that file onto its own device.
    expected = decided_by_rank_0(rank, check_snapshot, trainer.snapshot_path, args,
                                WineMLP)
    resumed = expected is not None
    if resumed:
        snapshot = trainer.load_snapshot(expected)
        if trainer.is_main_process:
            done = trainer.epochs_completed
            next_step = (f"continuing at epoch {done + 1}" if done < args.epochs else
                         "nothing left to train (a larger --epochs goes on)")
            print(f"resuming from {trainer.snapshot_path}: {done} of {args.epochs} epochs done, "
                  f"{next_step}", flush=True)
            if snapshot["world_size"] != args.world_size:
                # The weights and the optimizer do not depend on the number of ranks; the
                # global batch does (--batch-size is per rank), and so the steps from here on.
                print(f"note: the snapshot was written by {snapshot['world_size']} ranks and "
                      f"{args.world_size} resume it: the global batch goes from "
                      f"{args.batch_size * snapshot['world_size']} to "
                      f"{args.batch_size * args.world_size}", flush=True)
    # --crash-at-epoch fails the job once: not again in a run that resumed, nor in torchrun's
    # restart of it (TORCHELASTIC_RESTART_COUNT counts those), or it would never get past it.
    resumed_after_epoch = trainer.epochs_completed
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    trainer.crash_at_epoch = None if resumed or restarted else args.crash_at_epoch

    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): "
              f"{len(train_set)} train / {len(test_set)} test wines, batch {args.batch_size} "
              f"per rank ({args.batch_size * args.world_size} in all)", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    correct, total = trainer.evaluate()
    if not trainer.is_main_process:
        return  # every rank holds the same results; rank 0 alone writes them

    torch.save(model.module.state_dict(), os.path.join(args.out_dir, "final.pt"))
    metrics = {
        "lesson": "04_checkpointing",
        "world_size": args.world_size,
        "launcher": args.launcher,
        "resumed_after_epoch": resumed_after_epoch,  # 0: this run started from scratch
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": optimizer.param_groups[0]["lr"],  # what the steps used, also after a resume
        "seed": args.seed,
        "threads_per_rank": torch.get_num_threads(),
        "train_loss": losses,
        "test_correct": correct,
        "test_total": total,
        "test_accuracy": correct / total,
        "train_seconds": train_seconds,
        "wall_seconds": time.time() - start,
    }
    with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


def worker(local_rank, args):
    """What each process runs, started by mp.spawn or torchrun: main, then leave the group."""
    # mp.spawn on one machine: the local rank is the global rank. torchrun says which it is.
    rank = int(os.environ["RANK"]) if args.launcher == "torchrun" else local_rank
    with rank_guard(rank, args):  # a failure becomes one line: guard_rails.py
        main(rank, local_rank, args)
        dist.destroy_process_group()


def launch(args):
    """Check any snapshot, pick backend and port, then start one process per rank; or, under
    torchrun, which has started them already, be one rank."""
    args.start_time = time.time()
    if started_by_torchrun():
        # torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: this process
        # is one rank. After a crash torchrun starts every rank again (--max-restarts), and the
        # snapshot brings them back to where the job was.
        args.launcher = "torchrun"
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        os.makedirs(args.out_dir, exist_ok=True)
        worker(int(os.environ["LOCAL_RANK"]), args)  # runs main, then ends this process
        return
    args.launcher = "spawn"
    args.backend = choose_backend(args.backend, args.world_size)
    # Checked here, once, before any rank starts: a snapshot that cannot be resumed is one line.
    check_snapshot(os.path.join(args.out_dir, "snapshot.pt"), args, WineMLP)
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
    with spawn_guard("rank", ". Run the same command again to resume from the last snapshot"):
        mp.spawn(worker, args=(args,), nprocs=args.world_size)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 04: DDP with snapshots and automatic resume (mp.spawn or torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write snapshot.pt every N epochs, and after the last")
    parser.add_argument("--out-dir", default="runs/04_checkpointing",
                        help="folder for snapshot.pt, final.pt and metrics.json; a snapshot "
                             "already there is resumed")
    parser.add_argument("--world-size", type=int,
                        default=torch.cuda.device_count() or 2,
                        help="number of processes (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others (to start, or in any "
                             "collective) before giving up with an error")
    parser.add_argument("--crash-at-epoch", type=int, default=None,
                        help="make one rank fail at the start of this epoch (once: not in a "
                             "run that resumed, nor in a torchrun restart), to try a resume")
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
