"""Lesson 09: tensor parallelism, for layers too large for one device, and 2-D with FSDP.

Lesson 07's program, with each layer split over the --tp ranks of a TP group (tensor_parallel.py:
column-wise, then row-wise, Megatron-LM's layout) and lesson 07's FSDP across --dp such groups, on
a dp x tp mesh: TP alone takes one process's steps, 2-D those of DDP on --dp ranks. Every rank
saves its slices in --out-dir, and a run resumes from them with any --dp and --tp (so
give each run its own --out-dir). torchrun starts it too, as in lesson 04.

Run it:
    python 09_tensor_parallel/train.py                        # --tp 2 on 2 CPU ranks, or every GPU
    python 09_tensor_parallel/train.py --dp 2 --tp 2 --out-dir runs/09_2d   # 2-D on 4 ranks
    python 09_tensor_parallel/train.py --layers 3 --out-dir runs/09_deep     # two pairs of layers
    torchrun --standalone --nproc-per-node 4 09_tensor_parallel/train.py --tp 2 --out-dir runs/09_tr
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import guard_rails
from data import load_data
from memory import memory_baseline, memory_per_rank, memory_rows, print_memory
from mesh import build_mesh
from model import WineMLP
from sharding import latest_checkpoint, load_sharded, save_sharded
from tensor_parallel import StepCollectives, print_collectives, show_who_reads_what, split_model


# ---------------------------------------------------------------------------------------------
# The lesson: the training step, and how the data and the model come in
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir,
                 mesh, args):
        self.model = model
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # from the group
        self.is_main_process = self.rank == 0  # gates printing and writing: one copy, not N
        self.strategy = args.strategy = f"--dp {args.dp} --tp {args.tp}"  # the layout, as 07's
        self.mesh = mesh
        # The Adam that holds this rank's state: ZeroRedundancyOptimizer keeps its share in .optim.
        self.adam = getattr(optimizer, "optim", optimizer)
        self.dp_group = mesh["dp"].get_group()  # the ranks that read different batches
        self.collectives = StepCollectives()  # what the first step sends (tensor_parallel.py)
        # Where training stands: what a checkpoint saves and a resume restores.
        self.checkpoint_dir = os.path.join(out_dir, "checkpoint")
        self.epochs_completed, self.losses = 0, []

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        with self.collectives.first_time("forward"):  # counted in the run's first step
            # Each row-wise layer all-reduces its partial sums: fc2 the logits, whole on every rank.
            loss = F.cross_entropy(self.model(features), labels)
        with self.collectives.first_time("backward"):
            # A column-wise one's input gradient too (not fc1's); FSDP reduce-scatters over "dp".
            loss.backward()
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
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.dp_group)  # a TP group's once
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """Count correct predictions over the whole test set."""
        self.model.eval()
        # A stride by dp rank: each test wine goes to exactly one TP group, whose ranks all use it.
        dp_rank, dp = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        features = self.test_set.features[dp_rank::dp].to(self.device)
        labels = self.test_set.labels[dp_rank::dp].to(self.device)
        # Under FSDP every rank calls the model, even with no test wines: its forward gathers.
        predictions = self.model(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.dp_group)
        return int(counts[0]), int(counts[1])

    def save_checkpoint(self, epoch):
        # Every rank writes what it holds, each tensor once (one held on several: by one of them).
        save_sharded(self.checkpoint_dir, self.model, self.adam,
                     {"epochs_completed": epoch + 1, "train_loss": self.losses,
                      "strategy": self.strategy, "world_size": self.world_size})

    def train(self, max_epochs):
        losses = self.losses  # after a resume, those of the epochs the checkpoint holds
        for epoch in range(self.epochs_completed, max_epochs):  # none repeated, none skipped
            start = time.perf_counter()
            loss = self.train_epoch(epoch)
            losses.append(loss)
            if self.is_main_process:
                print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                      f"| {time.perf_counter() - start:.3f} s", flush=True)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self.save_checkpoint(epoch)
        return losses


def prepare_dataloader(dataset, batch_size, seed, rank, world_size):
    # Each rank gets a disjoint slice of one seeded shuffle, padded with repeats so that all
    # run the same number of steps (one step fewer would leave the others waiting forever).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def build_model(args, device, mesh):
    """The wine MLP, on this rank's device, split by TP over "tp" and sharded by FSDP over "dp"."""
    # Seed before building the model so the initial weights are the same on every run.
    torch.manual_seed(args.seed)
    model = WineMLP(hidden=args.hidden, layers=args.layers).to(device)
    split_model(model, mesh)  # tensor_parallel.py
    return model


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, args.world_size, args.backend, args.timeout)
    baseline = memory_baseline(device)  # before the model, so the peak covers all of training
    mesh = build_mesh(device, args.timeout, dp=args.dp, tp=args.tp)  # row d: TP group d
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed,
                                      mesh["dp"].get_local_rank(), args.dp)  # by TP group
    show_who_reads_what(rank, mesh, train_loader)  # a TP group's ranks read the same wines
    model = build_model(args, device, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, mesh, args)
    resumed_after_epoch = resume(trainer, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}, {args.strategy}): "
              f"{len(train_set)} train / {len(test_set)} test wines, batch {args.batch_size} "
              f"per TP group ({args.batch_size * args.dp} in all)", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    # Before evaluating, which gathers layers again; a run that took no step has nothing to show.
    memory = (memory_per_rank(model, trainer.adam, device, baseline)
              if resumed_after_epoch < args.epochs else [])
    correct, total = trainer.evaluate()
    weights = cpu_state_dict(model)  # a collective: every rank takes part
    if not trainer.is_main_process:
        return  # rank 0 holds every result now; it alone writes them
    save_atomically(weights, os.path.join(args.out_dir, "final.pt"))
    print_collectives(trainer.collectives.counts, args)
    print_memory(memory, f"{args.strategy}, {args.world_size} ranks, hidden {args.hidden}")
    results = {"train_loss": losses, "test_correct": correct, "test_total": total,
               "test_accuracy": correct / total, "train_seconds": train_seconds,
               "wall_seconds": time.time() - start, "memory": memory_rows(memory),
               "collectives_first_step": trainer.collectives.counts,
               "resumed_after_epoch": resumed_after_epoch}
    save_atomically(describe_run(args, device) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


# =============================================================================================
# Plumbing: how the lesson starts, saves and reads its flags. Every lesson ends with it, and only
# the lesson that teaches a piece of it changes that piece: read it once, skip it after.
# =============================================================================================
def choose_backend(requested, world_size, flag="--world-size"):
    """NCCL when every rank can have its own GPU, else gloo on the CPU."""
    guard_rails.check_backend(requested, world_size, flag)  # --backend nccl that cannot work
    if requested == "nccl" or (requested == "auto" and dist.is_nccl_available()
                               and 0 < world_size <= torch.cuda.device_count()):
        return "nccl"
    return "gloo"


def setup_process_group(rank, world_size, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    # This machine's GPU and ranks: torchrun's (only under it: some clusters set LOCAL_RANK).
    local_rank, local_ranks = ((int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
                               if dist.is_torchelastic_launched() else (rank, world_size))
    if backend == "nccl":
        # Pin each rank to its own GPU before anything touches CUDA, or all of them use GPU 0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # The ranks share the cores: each gets its share of threads, or they fight over them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // local_ranks))
        device = torch.device("cpu")
    # Meet rank 0 at MASTER_ADDR:MASTER_PORT; timeout bounds this wait and every collective after.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            store=guard_rails.restart_store(rank, world_size, timeout),  # restarts
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def worker(local_rank, main, args):
    # mp.spawn on one machine: the local rank is the global rank. torchrun says which it is.
    rank = int(os.environ["RANK"]) if dist.is_torchelastic_launched() else local_rank
    with guard_rails.rank_guard(rank, args):  # a failure becomes one line: guard_rails.py
        main(rank, args)
        dist.destroy_process_group()


def launch(main, args):
    """Pick the backend and rank 0's port, then run main in world_size new processes."""
    args.start_time = time.time()
    if dist.is_torchelastic_launched():
        # torchrun started this process as one rank and set RANK, LOCAL_RANK, WORLD_SIZE,
        # LOCAL_WORLD_SIZE (the ranks on this machine), MASTER_ADDR and MASTER_PORT.
        args.world_size = int(os.environ["WORLD_SIZE"])
        guard_rails.check_tensor_parallel(args)  # --dp (default: WORLD_SIZE / --tp) x --tp
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        guard_rails.check_backends_agree(args.backend, args.timeout)  # every node chose the same
        guard_rails.check_sharding(args, latest_checkpoint)
        return worker(int(os.environ["LOCAL_RANK"]), main, args)
    guard_rails.check_tensor_parallel(args)  # --tp divides --hidden, --layers pairs up
    args.world_size = args.dp * args.tp
    args.backend = choose_backend(args.backend, args.world_size, "--dp x --tp")
    guard_rails.check_sharding(args, latest_checkpoint)  # the width and any checkpoint
    # Rank 0 listens on this machine: a MASTER_PORT already set wins, else any free port.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(guard_rails.find_free_port()))
    print(f"starting {args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # mp.spawn(worker, args=(main, args), nprocs=args.world_size): ranks 0 .. world_size - 1,
    # each forked from a server that has imported torch and these once (lesson 02's README).
    preload = ["torch._dynamo", "sklearn.datasets", "sklearn.model_selection",
               "sklearn.preprocessing"]
    with guard_rails.spawn_guard("rank", then=". Run it again to resume from the last checkpoint"):
        guard_rails.start_ranks(worker, (main, args), args.world_size, preload)


def cpu_state_dict(model):
    # As CPU tensors the weights load on any machine as they are, with a GPU or without.
    # Whole: gathered from every rank's shards (a collective) onto rank 0; the others get {}.
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


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


def resume(trainer, args):
    """Load the newest finished checkpoint in --out-dir, if any; return the epochs it holds."""
    # Rank 0 picks it for every rank, once each has shown it sees the folder (guard_rails.py).
    checkpoint = guard_rails.agree_on_checkpoint(trainer.rank, trainer.checkpoint_dir,
                                                 latest_checkpoint)
    if checkpoint:
        progress = load_sharded(checkpoint, trainer.model, trainer.adam)  # sharding.py
        trainer.epochs_completed = progress["epochs_completed"]
        trainer.losses = progress["train_loss"]
        if trainer.is_main_process:
            print(f"resuming from {checkpoint}: {trainer.epochs_completed} of {args.epochs} "
                  f"epochs done, written by {progress['strategy']} on "
                  f"{progress['world_size']} ranks, loaded by {args.strategy} on "
                  f"{args.world_size}", flush=True)
    if trainer.epochs_completed == args.epochs and trainer.is_main_process:
        print(f"note: {checkpoint} already holds all {args.epochs} epochs: nothing left to "
              "train; raise --epochs to train on, or choose another --out-dir to start afresh",
              flush=True)
    return trainer.epochs_completed


LESSON = os.path.basename(os.path.dirname(os.path.abspath(__file__)))  # this folder's name


def describe_run(args, device):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": LESSON,
        "strategy": args.strategy,
        "dp": args.dp,
        "tp": args.tp,
        "hidden": args.hidden,
        "layers": args.layers,
        "world_size": args.world_size,
        "launcher": "torchrun" if dist.is_torchelastic_launched() else "spawn",
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "threads_per_rank": torch.get_num_threads(),
        "peak_memory_measure": "cuda_max_allocated" if device.type == "cuda" else "max_rss",
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.partition("\n")[0],  # the docstring's first line
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--tp", type=int, default=2, help="ranks that split each layer: a TP group")
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
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
