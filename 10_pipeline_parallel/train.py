"""Lesson 10: pipeline parallelism, for a model too deep for one device.

Lesson 09's program, with its layers no longer split across ranks but dealt out whole: lesson
08's deeper MLP (--layers), cut into --stages consecutive groups of layers, one per rank. Each
batch is cut into --microbatches, and a stage passes a micro-batch's activations to the next
(and, in backward, the gradients back) while it works on the following one. The schedule decides
the order of those forwards and backwards, and how long the stages wait: the bubble. The lesson
writes the simplest schedule by hand (afab: all forwards, then all backwards, with send and recv),
then runs torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B. Every schedule takes
the steps of one process on the whole batch; --dp M pipelines take the steps of DDP on M ranks.
--simulate-ms gives each layer a fixed compute time, so the bubble can be measured (timeline.py).
The idea lives in pipeline.py: read it first.

Run it (each run its own --out-dir, or it resumes the finished checkpoint of the one before):
    python 10_pipeline_parallel/train.py                                     # 1F1B, 2 stages
    python 10_pipeline_parallel/train.py --schedule afab --out-dir runs/10_afab   # by hand
    python 10_pipeline_parallel/train.py --stages 4 --microbatches 8 --simulate-ms 20 \
        --epochs 1 --out-dir runs/10_bubble                       # the bubble, measured
    python 10_pipeline_parallel/train.py --dp 2 --stages 2 --out-dir runs/10_2d  # 2 pipelines
    torchrun --standalone --nproc-per-node 4 10_pipeline_parallel/train.py --stages 4 \
        --out-dir runs/10_tr
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        10_pipeline_parallel/train.py --stages 4 --out-dir /shared/runs/10   # node 1: --node-rank 1
"""

import argparse
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from guard_rails import (
    agree_on_checkpoint,
    check_args,
    check_backends_agree,
    check_master_port,
    check_pipeline,
    check_sharding,
    fail,
    rank_guard,
    restart_store,
    sharded_save_or_fail,
    spawn_guard,
    start,
    started_by_torchrun,
)
from pipeline import (
    IGNORE,
    SCHEDULES,
    afab_step,
    average_gradients,
    build_groups,
    build_schedule,
    layers_per_stage,
    pad_batch,
    split_model,
)
from timeline import print_schedule_report, schedule_report, simulate_compute


# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------
def choose_backend(requested, world_size, flag="--dp x --stages"):
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
    def __init__(self, model, stages, stage_ids, train_loader, optimizer, device, args, rank,
                 pp_group, dp_group):
        self.model = model  # this rank's layers, under the whole model's names
        self.stages = stages
        self.stage_ids = stage_ids
        self.train_loader = train_loader
        self.optimizer = optimizer
        self.device = device
        self.args = args
        self.save_every = args.save_every
        self.rank = rank
        self.is_main_process = rank == 0  # gates printing and writing: one copy, not N
        self.pp_group = pp_group  # this rank's pipeline: send and recv run along it
        self.dp_group = dp_group  # the ranks with the same layers, in the other pipelines
        num_stages = args.stages * len(stage_ids)
        self.has_last_stage = num_stages - 1 in stage_ids  # it alone computes the loss
        self.real_rows = None  # rows of this batch that are not padding, for loss_fn
        self.schedule = None if args.schedule == "afab" else build_schedule(
            args.schedule, stages, stage_ids, num_stages, args.microbatches, self.loss_fn,
            device, pp_group)
        self.events = []  # with --simulate-ms: this step's forwards and backwards
        self.timeline = []  # and every step's
        if args.simulate_ms is not None:
            for stage, s in zip(stages, stage_ids, strict=True):
                simulate_compute(stage, s, args.simulate_ms, self.events)
        # Where training stands: what a checkpoint saves and a resume restores.
        self.checkpoint_dir = os.path.join(args.out_dir, "checkpoint")
        self.epochs_completed = 0
        self.losses = []

    def loss_fn(self, logits, targets):
        """A micro-batch's share of the batch's mean loss: the sum of its rows' losses over the
        batch's real rows. The micro-batches' shares add up to the mean over the whole batch,
        and padding rows (target IGNORE) add nothing."""
        return F.cross_entropy(logits, targets, ignore_index=IGNORE,
                               reduction="sum") / self.real_rows

    def train_step(self, features, labels):
        """One step on a batch padded to --batch-size; returns the sum of its real rows' losses
        on the rank with the last stage (0 elsewhere)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.real_rows = int((labels != IGNORE).sum())
        if self.schedule is None:
            losses = afab_step(self.stages[0], features, labels, self.args.microbatches,
                               self.loss_fn, self.pp_group)
        else:
            losses = []  # filled on the last stage, one loss per micro-batch
            # The schedule cuts the features for the first stage, the labels for the last.
            first = (features,) if 0 in self.stage_ids else ()
            self.schedule.step(*first, target=labels if self.has_last_stage else None,
                               losses=losses)
        if self.args.dp > 1:
            average_gradients(self.stages, self.dp_group)
        self.optimizer.step()
        if self.args.simulate_ms is not None:
            self.timeline.append(list(self.events))
            self.events.clear()
        return float(sum(loss.detach() for loss in losses)) * self.real_rows if losses else 0.0

    def train_epoch(self, epoch):
        self.train_loader.sampler.set_epoch(epoch)  # else every epoch has the same order
        totals = torch.zeros(2, device=self.device)  # [sum of per-sample losses, samples]
        for features, labels in self.train_loader:
            rows = len(labels)
            features, labels = pad_batch(features, labels, self.args.batch_size)
            loss_sum = self.train_step(features.to(self.device), labels.to(self.device))
            if self.has_last_stage:
                totals += torch.tensor([loss_sum, rows], device=self.device)
        # Only the last stage of each pipeline saw the loss: a sum over every rank (the others
        # add zeros) brings every pipeline's to rank 0, which holds the first stage.
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return (totals[0] / totals[1]).item()

    def whole_model(self):
        """Every rank's layers, gathered onto rank 0 into the whole model (lesson 01's class)."""
        mine = {name: t.detach().cpu() for name, t in self.model.state_dict().items()}
        pieces = [None] * dist.get_world_size() if self.is_main_process else None
        dist.gather_object(mine, pieces, dst=0)  # a collective: every rank takes part
        if not self.is_main_process:
            return None
        model = WineMLP(hidden=self.args.hidden, layers=self.args.layers)
        # strict: a layer that no rank held would stop here, not make a half-trained final.pt
        model.load_state_dict({name: t for piece in pieces for name, t in piece.items()})
        return model

    def training_state(self):
        """{"model": ..., "optimizer": ...}: this rank's layers and their Adam state, by name."""
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
                               "dp": self.args.dp, "stages": self.args.stages,
                               "schedule": self.args.schedule}, f)
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
        # needs now: the checkpoint loads whatever --dp, --stages and --schedule wrote it.
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
                self.save_checkpoint()  # every rank: each holds layers that others do not
        return self.losses


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, local_rank, args):
    device = setup_process_group(rank, local_rank, args.world_size, args.backend, args.timeout)
    train_set, test_set = load_data()
    pp_group, dp_group = build_groups(args.dp, args.stages, args.timeout)
    pp_rank, dp_rank = dist.get_rank(pp_group), dist.get_rank(dp_group)  # stage, pipeline
    train_loader = loader_per_pipeline(train_set, dp_rank, args)
    model, stages, stage_ids = build_stages(args, device, pp_rank, rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, stages, stage_ids, train_loader, optimizer, device, args, rank,
                      pp_group, dp_group)

    resumed_after_epoch = resume(trainer, rank, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): --dp {args.dp} "
              f"x --stages {args.stages}, --schedule {args.schedule}, batch {args.batch_size} "
              f"per pipeline in {args.microbatches} micro-batches", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    # With --simulate-ms: every rank's timeline to rank 0, which measures the bubble.
    report = schedule_report(trainer, pp_rank) if trainer.timeline else None
    model = trainer.whole_model()  # a collective: every rank sends its layers to rank 0
    if not trainer.is_main_process:
        return  # rank 0 holds every result now; it alone writes them

    save_atomically(model.state_dict(), os.path.join(args.out_dir, "final.pt"))
    correct, total = evaluate_whole(model, test_set)
    if report:
        print_schedule_report(report, args)
    results = {"schedule_report": report, "train_loss": losses, "test_correct": correct,
               "test_total": total, "test_accuracy": correct / total,
               "train_seconds": train_seconds, "wall_seconds": time.time() - args.start_time}
    save_atomically(describe_run(args, device, resumed_after_epoch) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


def loader_per_pipeline(train_set, dp_rank, args):
    """The sampler deals batches to the pipelines (by dp rank), not to the ranks: every stage of
    a pipeline works on the same samples, the first on their features, the last their labels."""
    return prepare_dataloader(train_set, args.batch_size, args.seed, dp_rank, args.dp)


def build_stages(args, device, pp_rank, rank):
    """The model, with this rank's stages cut out of it: (model, stages, their stage ids)."""
    # Seed before building the model so the initial weights are the same on every rank.
    torch.manual_seed(args.seed)
    model = WineMLP(hidden=args.hidden, layers=args.layers).to(device)
    chunks = 2 if args.schedule == "interleaved" else 1
    # One stage per rank; interleaved: v = 2 smaller ones, stages r and r + p on rank r.
    stage_ids = [pp_rank + c * args.stages for c in range(chunks)]
    plan = layers_per_stage(model, args.stages * chunks)  # before split_model drops layers
    stages = split_model(model, stage_ids, args.stages * chunks)
    if rank == 0:  # which layers each stage holds, and where: stage s on rank s % --stages
        print("layers: " + " | ".join(f"stage {s} on rank {s % args.stages}: " + " ".join(names)
                                      for s, names in enumerate(plan)), flush=True)
    return model, stages, stage_ids


def resume(trainer, rank, args):
    """Load the newest finished checkpoint in --out-dir, if any; return the epochs it holds."""
    # Automatic resume: a finished checkpoint in --out-dir means an earlier run got this far.
    # Rank 0 picks it for every rank, once each has shown it sees the folder (guard_rails.py).
    checkpoint = agree_on_checkpoint(rank, trainer.checkpoint_dir, latest_checkpoint)
    if checkpoint:
        progress = trainer.load_checkpoint(checkpoint)
        if trainer.is_main_process:
            print(f"resuming from {checkpoint}: {trainer.epochs_completed} of {args.epochs} "
                  f"epochs done, written by --dp {progress['dp']} --stages {progress['stages']} "
                  f"--schedule {progress['schedule']}", flush=True)
    if trainer.epochs_completed == args.epochs and trainer.is_main_process:
        print(f"note: {checkpoint} already holds all {args.epochs} epochs: nothing left to "
              "train; raise --epochs to train on, or choose another --out-dir to start afresh",
              flush=True)
    return trainer.epochs_completed


@torch.no_grad()
def evaluate_whole(model, test_set):
    """The whole model, on rank 0's CPU, over every test wine: (correct, total)."""
    correct = int((model(test_set.features).argmax(dim=1) == test_set.labels).sum())
    return correct, len(test_set)


def describe_run(args, device, resumed_after_epoch):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": "10_pipeline_parallel",
        "dp": args.dp,
        "stages": args.stages,
        "schedule": args.schedule,
        "microbatches": args.microbatches,
        "hidden": args.hidden,
        "layers": args.layers,
        "simulate_ms": args.simulate_ms,
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
        # is one rank. The ranks of every node form one group, the pipelines, one checkpoint.
        args.launcher = "torchrun"
        args.world_size = int(os.environ["WORLD_SIZE"])
        check_pipeline(args)  # --dp (default: WORLD_SIZE / --stages) x --stages = WORLD_SIZE
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        check_backends_agree(args.backend, args.timeout)  # every node chose the same one
        check_sharding(args, latest_checkpoint)
        worker(int(os.environ["LOCAL_RANK"]), args)  # runs main, then ends this process
        return
    args.launcher = "spawn"
    check_pipeline(args)  # the layers split over the stages, the batch into micro-batches
    args.world_size = args.dp * args.stages
    args.backend = choose_backend(args.backend, args.world_size)
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
        description="Lesson 10: train the wine MLP as a pipeline of stages, one per rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="samples per step, per pipeline; a short last batch is padded")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default="runs/10_pipeline_parallel",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--schedule", default="1f1b", choices=["afab", *SCHEDULES],
                        help="afab: this lesson's own, by hand; the others: the library's")
    parser.add_argument("--stages", type=int, default=2, help="ranks in a pipeline")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="micro-batches each batch is cut into; must divide --batch-size")
    parser.add_argument("--dp", type=int,
                        help="pipelines that read different batches, gradients averaged "
                        "(default: the GPUs, or torchrun's ranks, / --stages; at least 1)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden units; 64 is lesson 01's model")
    parser.add_argument("--layers", type=int, default=3,
                        help="hidden layers (lesson 08's): --layers + 1 linear layers to split")
    parser.add_argument("--simulate-ms", type=float,
                        help="each layer computes this long (forward; backward twice): the "
                        "bubble, measured, and each rank's order of forwards and backwards")
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
