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
import contextlib
import datetime
import hashlib
import io
import json
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
        snapshot = load_same_snapshot(self.snapshot_path, expected, self.device)
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
    expected = decided_by_rank_0(rank, check_snapshot, trainer.snapshot_path, args)
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
    with rank_guard(rank, args):  # a failure becomes one line; see the guard rails below
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
    check_snapshot(os.path.join(args.out_dir, "snapshot.pt"), args)
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
# Guard rails of this lesson: a snapshot that cannot continue this run, or that some rank
# cannot see, and the store torchrun's restarts need
# ---------------------------------------------------------------------------------------------
SNAPSHOT_KEYS = ("model", "optimizer", "epochs_completed", "train_loss", "world_size",
                 "settings")


def run_settings(args):
    """The flags that define a run: a snapshot continues only a run with the same ones. The
    number of ranks may change (see main); --epochs may grow; the others change no result."""
    return {"lr": args.lr, "seed": args.seed, "batch-size": args.batch_size}


def check_snapshot(path, args):
    """None if there is no snapshot at path; else what every rank must find there (epochs
    done, world size, the file's SHA-256). Stops with one line if it cannot be resumed."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    try:
        # weights_only=True loads tensors and plain containers only: a file that tries to
        # build other objects is refused, so a snapshot from elsewhere cannot run code.
        snapshot = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # a damaged file raises one of several types, torch's or pickle's
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        fail(f"{path} cannot be loaded ({type(error).__name__}: {reason[:150]}); it is damaged "
             "or not a snapshot: restore a good copy, or delete it to train from scratch")
    missing = [key for key in SNAPSHOT_KEYS
               if not isinstance(snapshot, dict) or key not in snapshot]
    if missing:
        fail(f"{path} is not a snapshot of this lesson (no {', '.join(missing)}); delete it or "
             "choose another --out-dir")
    if snapshot["epochs_completed"] > args.epochs:
        fail(f"{path} has {snapshot['epochs_completed']} epochs done, more than --epochs "
             f"{args.epochs}; ask for at least {snapshot['epochs_completed']} or choose another "
             "--out-dir")
    try:
        WineMLP().load_state_dict(snapshot["model"])  # the same layers with the same shapes?
    except RuntimeError as error:
        fail(f"{path} holds a different model ({str(error).splitlines()[-1].strip()[:150]}); "
             "delete it or choose another --out-dir")
    for flag, value in run_settings(args).items():
        saved = snapshot["settings"].get(flag)
        if saved != value:
            fail(f"--{flag} {value} differs from the run in {path}, which used --{flag} "
                 f"{saved}; resume it with --{flag} {saved}, or start a new run with another "
                 "--out-dir")
    return {"epochs_completed": snapshot["epochs_completed"],
            "world_size": snapshot["world_size"], "sha256": hashlib.sha256(data).hexdigest()}


def decided_by_rank_0(rank, decide, *decide_args):
    """decide(*decide_args) on rank 0 alone, its answer handed to every rank. If rank 0 stops
    with an error, it says so once and every rank ends, none left waiting for it."""
    answer = [None]
    if rank == 0:
        try:
            answer = [("go", decide(*decide_args))]
        except SystemExit as stop:
            answer = [("stop", stop.code)]
    dist.broadcast_object_list(answer, src=0)
    verdict, value = answer[0]
    if verdict == "stop":
        sys.exit(value if rank == 0 else 1)
    return value


def load_same_snapshot(path, expected, device):
    """Load the snapshot rank 0 decided on, onto this rank's device, after every rank has
    checked that it sees that very file; else the job stops with one line, not a hang."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        seen = hashlib.sha256(data).hexdigest()
    except OSError as error:
        data, seen = None, f"cannot read {path} ({error.strerror})"
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), seen))
    for other, (host, other_seen) in enumerate(views):
        if other_seen != expected["sha256"]:
            what = (other_seen if other_seen.startswith("cannot read") else
                    f"sees another version of {path}")
            sys.exit(f"error: rank {other} (host {host}) {what}, the snapshot that rank 0 "
                     f"resumes from at epoch {expected['epochs_completed'] + 1}; every rank must "
                     "see the same --out-dir, on a filesystem shared by all nodes"
                     if dist.get_rank() == 0 else 1)
    # map_location: the tensors were saved from global rank 0's device, so the file says
    # cuda:0. Without it, every rank would load its copy onto cuda:0, crowding that GPU; with
    # it, rank r's copy goes to its own cuda:r (or the CPU). weights_only=True, as above.
    return torch.load(io.BytesIO(data), map_location=device, weights_only=True)


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
