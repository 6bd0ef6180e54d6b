"""Lesson 13, the capstone: one tiny GPT trained with FSDP x TP x PP on one device mesh.

Lesson 11's program, its tiny GPT (model.py) now trained with three kinds of parallelism at once,
each a dimension of one (pp, dp, tp) mesh of ranks (parallelize.py, read it first): --pp stages
each keep their share of the blocks (lesson 10), --tp ranks split each stage's weights by heads
and by hidden units, with the sequence split over them between (lesson 09), and --dp copies of
that pipeline read different sequences, their weights sharded by FSDP (lesson 07). The default,
--dp 2 --pp 2 --tp 2, is 8 ranks: a small cluster's layout, on a laptop. Every layout takes
one process's steps.
Every rank saves in --out-dir, and a run resumes from it in any other layout (so
give each run its own --out-dir). torchrun starts it too, as in lesson 04.

Run it:
    python 13_capstone/train.py                                            # 8 ranks: 2 x 2 x 2
    python 13_capstone/train.py --dp 1 --pp 1 --tp 1 --out-dir runs/13_one  # one process
    torchrun --standalone --nproc-per-node 4 13_capstone/train.py --pp 2 --tp 2 --out-dir runs/13_t
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import guard_rails
from data import load_data
from model import TinyGPT, complete, loss_sum, validation_loss
from parallelize import (
    build_mesh,
    bytes_per_rank,
    clip_whole_model,
    keep_stage,
    pipeline_schedule,
    shard_data_parallel,
    tensor_parallel,
)
from sharding import latest_checkpoint, load_sharded, save_sharded


# ---------------------------------------------------------------------------------------------
# The lesson: the training step, and how the data and the model come in
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, val_set, optimizer, device, save_every, out_dir,
                 mesh, schedule, args):
        self.model = model
        self.train_loader = train_loader
        self.val_set = val_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # from the group
        self.is_main_process = self.rank == 0  # gates printing and writing: one copy, not N
        self.strategy = args.strategy = f"--dp {args.dp} --pp {args.pp} --tp {args.tp}"  # as 07's
        self.mesh = mesh
        # The Adam that holds this rank's state: ZeroRedundancyOptimizer keeps its share in .optim.
        self.adam = getattr(optimizer, "optim", optimizer)
        self.schedule, self.max_norm = schedule, args.max_norm  # the pipeline's, and the clip's
        self.first, self.last = model.tokens is not None, model.head is not None  # the stage's ends
        # The last stage's ranks know the loss; one per TP group counts it, once.
        self.counts_loss = self.last and mesh["tp"].get_local_rank() == 0
        # Where training stands: what a checkpoint saves and a resume restores.
        self.checkpoint_dir = os.path.join(out_dir, "checkpoint")
        self.epochs_completed, self.losses = 0, []

    def train_step(self, inputs, targets):
        self.optimizer.zero_grad(set_to_none=True)
        # This dp rank's sequences, micro-batch by micro-batch through the stages: the first
        # feeds the characters in, the last gives its scores to loss_fn, and here the losses.
        losses = []
        self.schedule.step(*[inputs] if self.first else [],
                           target=targets if self.last else None, losses=losses)
        clip_whole_model(self.model.parameters(), self.max_norm, self.mesh["pp"].get_group())
        self.optimizer.step()
        return sum(loss.detach() for loss in losses) * targets.numel() if losses else 0.0

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)  # else every epoch has the same order
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        for inputs, targets in self.train_loader:
            loss = self.train_step(inputs.to(self.device), targets.to(self.device))
            if self.counts_loss:
                totals[0] += loss
                totals[1] += targets.numel()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank's tokens, counted once
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self, model, weights):
        """The mean loss over every validation token."""
        model.load_state_dict(weights)  # one process's model, on rank 0 alone
        model.to(self.device).eval()
        return validation_loss(model, *(t.to(self.device) for t in self.val_set.tensors))

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
    # Each rank gets a disjoint slice of one seeded shuffle, cut to the same length so that all
    # run the same number of steps (one step fewer would leave the others waiting forever).
    # Whole batches only (drop_last): every step's mean is over the global batch's tokens.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


def build_model(args, device, mesh):
    """The tiny GPT on this rank's device, its part of it (parallelize) and their schedule."""
    # Seed before building the model so the initial weights are the same on every run.
    torch.manual_seed(args.seed)
    model = TinyGPT(args.seq_len, args.dim, args.heads, args.layers).to(device)
    schedule = parallelize(model, mesh, device, args)
    return model, schedule


def parallelize(model, mesh, device, args):
    """This rank's part of the model, in the order that works (parallelize.py): its stage, split
    by TP, sharded by FSDP, in a pipeline schedule."""
    tokens = args.batch_size // args.dp * args.seq_len  # this dp rank's, in each step

    def loss_fn(logits, targets):
        # Each micro-batch's share of the mean over this dp rank's tokens; FSDP then averages
        # the dp ranks' gradients, so each step takes the whole global batch's mean.
        return loss_sum(logits, targets) / tokens  # model.py

    keep_stage(model, mesh["pp"].get_local_rank(), args.pp)
    if args.tp > 1:
        tensor_parallel(model, mesh["tp"])
    shard_data_parallel(model, mesh["dp"])
    return pipeline_schedule(model, mesh, device, args.schedule, args.microbatches, loss_fn)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, args.world_size, args.backend, args.timeout)
    if args.float64:  # the proofs: float32 rounds each layout's sums apart, Adam amplifies it
        torch.set_default_dtype(torch.float64)
    mesh = build_mesh(device.type, args.dp, args.pp, args.tp, args.timeout)  # parallelize.py
    train_set, val_set = load_data(args.seq_len)
    # --batch-size (the global batch) dealt by dp rank: a pipeline's ranks read the same sequences.
    train_loader = prepare_dataloader(train_set, args.batch_size // args.dp, args.seed,
                                      mesh["dp"].get_local_rank(), args.dp)
    model, schedule = build_model(args, device, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, val_set, optimizer, device, args.save_every,
                      args.out_dir, mesh, schedule, args)
    resumed_after_epoch = resume(trainer, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}, {args.strategy}): "
              f"{len(train_set)} train / {len(val_set)} validation sequences of {args.seq_len} "
              f"characters, {args.batch_size} per step", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    held, weights = bytes_per_rank(model, optimizer), cpu_state_dict(model, mesh)  # collectives
    if not trainer.is_main_process:
        return  # rank 0 holds every result now; it alone writes them
    save_atomically(weights, os.path.join(args.out_dir, "final.pt"))
    model = TinyGPT(args.seq_len, args.dim, args.heads, args.layers)  # all of it: the weights'
    val_loss = trainer.evaluate(model, weights)
    samples = {p: complete(model, p, args.seq_len, device) for p in ("3+4=", "8+9=", "0+6=")}
    steps = (args.epochs - resumed_after_epoch) * len(train_loader)
    results = {"train_loss": losses, "val_loss": val_loss, "samples": samples,
               "bytes_per_rank": held,
               "tokens_per_second": steps * args.batch_size * args.seq_len / train_seconds,
               "train_seconds": train_seconds, "wall_seconds": time.time() - start,
               "resumed_after_epoch": resumed_after_epoch}
    save_atomically(describe_run(args, device) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print("samples: " + " | ".join(f"{p}{s}" for p, s in samples.items()), flush=True)
    print(f"validation loss: {val_loss:.4f} "
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
        guard_rails.check_layout(args)  # --dp (default: WORLD_SIZE / (--pp x --tp))
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        guard_rails.check_backends_agree(args.backend, args.timeout)  # every node chose the same
        guard_rails.check_sharding(args, latest_checkpoint)
        return worker(int(os.environ["LOCAL_RANK"]), main, args)
    guard_rails.check_layout(args)  # the model splits over this layout: heads, layers, tokens
    args.world_size = args.dp * args.pp * args.tp
    args.backend = choose_backend(args.backend, args.world_size, "--dp x --pp x --tp")
    guard_rails.check_sharding(args, latest_checkpoint)  # the width and any checkpoint
    # Rank 0 listens on this machine: a MASTER_PORT already set wins, else any free port.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(guard_rails.find_free_port()))
    print(f"starting {args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # mp.spawn(worker, args=(main, args), nprocs=args.world_size): ranks 0 .. world_size - 1,
    # each forked from a server that has imported torch and these once (lesson 02's README).
    preload = ["torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
               "torch.distributed.pipelining"]
    with guard_rails.spawn_guard("rank", then=". Run it again to resume from the last checkpoint"):
        guard_rails.start_ranks(worker, (main, args), args.world_size, preload)


def cpu_state_dict(model, mesh):
    # As CPU tensors the weights load on any machine as they are, with a GPU or without.
    # Whole: each stage's gathered over its dp and tp ranks (full_tensor), then the stages'.
    mine = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
            for name, t in model.state_dict().items()}
    stages = [None] * mesh["pp"].size()
    dist.all_gather_object(stages, mine, group=mesh["pp"].get_group())
    return {name: t for stage in stages for name, t in stage.items()}


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
        "pp": args.pp,
        "tp": args.tp,
        "schedule": args.schedule,
        "microbatches": args.microbatches,
        "max_norm": args.max_norm,
        "seq_len": args.seq_len,
        "dim": args.dim,
        "heads": args.heads,
        "layers": args.layers,
        "float64": args.float64,
        "world_size": args.world_size,
        "launcher": "torchrun" if dist.is_torchelastic_launched() else "spawn",
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "threads_per_rank": torch.get_num_threads(),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.partition("\n")[0],  # the docstring's first line
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, in all")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--max-norm", type=float, default=1.0,
                        help="clip the gradients to this norm, the whole model's")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=5,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages, each its blocks")
    parser.add_argument("--tp", type=int, default=2,
                        help="ranks that split each stage's weights (a TP group)")
    parser.add_argument("--dp", type=int,
                        help="pipelines that read different sequences, sharded by FSDP (default: "
                        "torchrun's ranks / (--pp x --tp); else the most pipelines the GPUs hold "
                        "that --batch-size splits over; without enough GPUs, 2)")
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"],
                        help="the pipeline's order of micro-batches (lesson 10)")
    parser.add_argument("--microbatches", type=int, default=2,
                        help="micro-batches each dp rank's batch is cut into")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=32, help="the model's width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--float64", action="store_true",
                        help="compute in float64: the layouts then agree to ~1e-14")
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
