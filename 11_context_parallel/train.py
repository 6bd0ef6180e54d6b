"""Lesson 11: context parallelism, one sequence split over ranks, on the course's first transformer.

Lesson 09's program, with a tiny GPT (model.py) that learns to finish sums ("3+4=7", data.py)
in place of the wine MLP, and --cp ranks that split every sequence: each holds two of its chunks,
and attention passes the keys and values around the ring of them (ring_attention.py, read it
first). --dp such CP groups read different sequences; every layout takes one process's steps.
Every rank saves in --out-dir, and a run resumes from it in any other layout (so
give each run its own --out-dir). torchrun starts it too, as in lesson 04.

Run it:
    python 11_context_parallel/train.py --cp 1 --out-dir runs/11_one     # one process
    python 11_context_parallel/train.py                                  # CP on 2 ranks
    python 11_context_parallel/train.py --dp 2 --cp 2 --out-dir runs/11_2d   # 2 groups of 2
    torchrun --standalone --nproc-per-node 4 11_context_parallel/train.py --cp 4 --out-dir runs/11_t
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import guard_rails
from data import load_data
from gradients import sum_gradients
from mesh import build_mesh
from model import TinyGPT, complete, loss_sum
from ring_attention import local_part
from sharding import latest_checkpoint, load_sharded, save_sharded


# ---------------------------------------------------------------------------------------------
# The lesson: the training step, and how the data and the model come in
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, val_set, optimizer, device, save_every, out_dir,
                 mesh, args):
        self.model = model
        self.train_loader = train_loader
        self.val_set = val_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # from the group
        self.is_main_process = self.rank == 0  # gates printing and writing: one copy, not N
        self.strategy = args.strategy = f"--dp {args.dp} --cp {args.cp}"  # the layout, as 07's
        self.mesh = mesh
        # The Adam that holds this rank's state: ZeroRedundancyOptimizer keeps its share in .optim.
        self.adam = getattr(optimizer, "optim", optimizer)
        self.cp_rank, self.cp = mesh["cp"].get_local_rank(), mesh["cp"].size()  # which chunks
        # Where training stands: what a checkpoint saves and a resume restores.
        self.checkpoint_dir = os.path.join(out_dir, "checkpoint")
        self.epochs_completed, self.losses = 0, []

    def my_tokens(self, inputs, targets):
        """Its two chunks of each sequence: this rank's tokens, their targets and positions."""
        positions = torch.arange(inputs.shape[1], device=self.device)
        return [local_part(t.to(self.device), self.cp_rank, self.cp, dim=-1)
                for t in (inputs, targets, positions)]

    def train_step(self, inputs, targets, positions):
        self.optimizer.zero_grad(set_to_none=True)
        # The sum of this rank's tokens' losses over the global batch's tokens (every rank holds
        # as many): summed over the ranks, their gradients are the whole batch's mean's.
        loss = loss_sum(self.model, inputs, targets, positions)  # model.py
        (loss / (targets.numel() * self.world_size)).backward()  # the ring's backward too
        sum_gradients(self.model.parameters(), None)  # every weight on every rank: add them up
        self.optimizer.step()
        return loss.detach()

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)  # else every epoch has the same order
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        for inputs, targets in self.train_loader:
            inputs, targets, positions = self.my_tokens(inputs, targets)
            totals[0] += self.train_step(inputs, targets, positions)
            totals[1] += targets.numel()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank's tokens, counted once
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """The mean loss over every validation token."""
        self.model.eval()
        # A stride by dp rank: each sequence to one CP group, whose ranks all call the model.
        dp_rank, dp = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        inputs, targets, positions = self.my_tokens(*(t[dp_rank::dp] for t in self.val_set.tensors))
        totals = torch.tensor([loss_sum(self.model, inputs, targets, positions).item(),
                               targets.numel()], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return (totals[0] / totals[1]).item()

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
    """The tiny GPT, on this rank's device, whole on every rank, its attention by the ring."""
    # Seed before building the model so the initial weights are the same on every run.
    torch.manual_seed(args.seed)
    model = TinyGPT(args.seq_len, args.dim, args.heads, args.layers).to(device)
    model.use_cp_group(mesh["cp"].get_group() if args.cp > 1 else None)  # the ring over "cp"
    return model


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, args.world_size, args.backend, args.timeout)
    if args.float64:  # the proofs: float32 rounds each layout's sums apart, Adam amplifies it
        torch.set_default_dtype(torch.float64)
    mesh = build_mesh(device, args.timeout, dp=args.dp, cp=args.cp)  # row d: CP group d
    train_set, val_set = load_data(args.seq_len)
    # --batch-size (the global batch) dealt by dp rank: a CP group's ranks read the same sequences.
    train_loader = prepare_dataloader(train_set, args.batch_size // args.dp, args.seed,
                                      mesh["dp"].get_local_rank(), args.dp)
    model = build_model(args, device, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, val_set, optimizer, device, args.save_every,
                      args.out_dir, mesh, args)
    resumed_after_epoch = resume(trainer, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}, {args.strategy}): "
              f"{len(train_set)} train / {len(val_set)} validation sequences of {args.seq_len} "
              f"characters, {args.batch_size} per step", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    val_loss = trainer.evaluate()
    weights = cpu_state_dict(model)  # a collective: every rank takes part
    if not trainer.is_main_process:
        return  # rank 0 holds every result now; it alone writes them
    save_atomically(weights, os.path.join(args.out_dir, "final.pt"))
    model.use_cp_group(None)  # rank 0 alone, on whole sequences
    samples = {p: complete(model, p, args.seq_len, device) for p in ("3+4=", "8+9=", "0+6=")}
    results = {"train_loss": losses, "val_loss": val_loss, "samples": samples,
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
        guard_rails.check_context_parallel(args, load_data)  # --dp (default: WORLD_SIZE / --cp)
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        guard_rails.check_backends_agree(args.backend, args.timeout)  # every node chose the same
        guard_rails.check_sharding(args, latest_checkpoint)
        return worker(int(os.environ["LOCAL_RANK"]), main, args)
    guard_rails.check_context_parallel(args, load_data)  # --seq-len in 2 x --cp chunks, a step
    args.world_size = args.dp * args.cp
    args.backend = choose_backend(args.backend, args.world_size, "--dp x --cp")
    guard_rails.check_sharding(args, latest_checkpoint)  # the width and any checkpoint
    # Rank 0 listens on this machine: a MASTER_PORT already set wins, else any free port.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(guard_rails.find_free_port()))
    print(f"starting {args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # mp.spawn(worker, args=(main, args), nprocs=args.world_size): ranks 0 .. world_size - 1,
    # each forked from a server that has imported torch and these once (lesson 02's README).
    preload = ["torch._dynamo", "torch.distributed.checkpoint"]
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
        "cp": args.cp,
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
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, in all")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--cp", type=int, default=2, help="ranks that split a sequence: a CP group")
    parser.add_argument("--dp", type=int,
                        help="CP groups that read different sequences (default: torchrun's "
                        "ranks / --cp; else the most groups of --cp GPUs --batch-size splits over)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=32, help="the model's width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--float64", action="store_true",
                        help="compute in float64: the layouts then agree to ~1e-14")
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
