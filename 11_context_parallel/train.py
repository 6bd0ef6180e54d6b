"""Lesson 11: context parallelism, one sequence split over ranks, on the course's first transformer.

Lesson 09's program, with a tiny GPT in place of the wine MLP: it reads lines of sums ("12+34=46")
a character at a time and learns to continue them. --cp N ranks split every sequence: each holds
two of its 2N chunks (balanced, so that the causal mask gives every rank the same work), and
attention, the only part that mixes tokens, passes the keys and values around the ring of N
ranks (ring_attention.py, read it first). --dp M groups of them read different sequences.
Every layout takes one process's steps: --batch-size is the global batch, sequences per step,
split over the --dp groups. The checkpoint is lesson 09's, and loads into any --dp and --cp.

Run it (each run its own --out-dir, or it resumes the finished checkpoint of the one before):
    python 11_context_parallel/train.py --cp 1 --out-dir runs/11_one     # one process
    python 11_context_parallel/train.py                                  # CP on 2 ranks
    python 11_context_parallel/train.py --dp 2 --cp 2 --out-dir runs/11_2d
    torchrun --standalone --nproc-per-node 4 11_context_parallel/train.py --cp 4 --out-dir runs/11_t
"""

import argparse
import datetime
import glob
import json
import os
import random
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
    get_state_dict,
    set_state_dict,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from guard_rails import (
    agree_on_checkpoint,
    check_args,
    check_backends_agree,
    check_context_parallel,
    check_master_port,
    check_sharding,
    fail,
    rank_guard,
    restart_store,
    sharded_save_or_fail,
    spawn_guard,
    start,
    started_by_torchrun,
)
from ring_attention import attend_block, local_part, ring_attention


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
    """mp.spawn(fn, args, nprocs), each rank forked from a server that has imported torch once,
    not a fresh Python that imports it again (lesson 02's README)."""
    if sys.platform != "linux":  # macOS and Windows: spawn, Python's default there
        return mp.spawn(fn, args=args, nprocs=nprocs)
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint"])
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
# Data: lines of sums, a character at a time
# ---------------------------------------------------------------------------------------------
VOCAB = "0123456789+=\n"  # every character the text holds


def make_text(lines, seed):
    """lines of "a+b=c" with a and b from 0 to 9: text every learner has, made here, the same
    on every machine and every Python (a corpus shipped with Python changes between versions)."""
    pick = random.Random(seed)
    return "".join(f"{a}+{b}={a + b}\n" for a, b in
                   ((pick.randrange(10), pick.randrange(10)) for _ in range(lines)))


def load_data(seq_len):
    """Training and validation sequences of seq_len + 1 characters (inputs and the next
    character to predict), cut from two texts of the same sums in different random orders; the
    same in every lesson run."""
    def windows(text):
        ids = torch.tensor([VOCAB.index(c) for c in text])
        count = (len(ids) - 1) // seq_len
        return TensorDataset(ids[:count * seq_len + 1].unfold(0, seq_len + 1, seq_len))

    return windows(make_text(4000, seed=0)), windows(make_text(400, seed=1))


def prepare_dataloader(dataset, batch_size, seed, rank, world_size):
    # Each data-parallel group gets a disjoint slice of one seeded shuffle; drop_last: every step
    # holds the whole global batch, so each step's mean is over the same number of tokens.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


# ---------------------------------------------------------------------------------------------
# Model: a tiny GPT
# ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal self-attention. On one rank it attends within its tokens; with a CP group its
    tokens are two chunks of the sequence, and ring_attention brings every rank's keys."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        # No bias on q, k, v: a key bias adds q . b to all of a query's scores, which softmax
        # cancels, so its gradient is 0 but for rounding, and Adam turns rounding into steps.
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.cp_group = None  # set by main when --cp > 1

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        if self.cp_group is None:
            y = attend_block(q, k, v, 0, 0)[0]  # the whole sequence: one chunk, causal
        else:
            y = ring_attention(q, k, v, self.cp_group)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Characters -> embeddings (of the character and of its position) -> pre-norm blocks ->
    a score for every next character."""

    def __init__(self, seq_len, dim=32, heads=4, layers=2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(len(VOCAB), dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, len(VOCAB))

    def forward(self, ids, positions):
        """ids: [batch, tokens] characters; positions: [tokens], where they are in the sequence
        (with CP, this rank's two chunks)."""
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def use_cp_group(self, group):
        for block in self.blocks:
            block.attn.cp_group = group


@torch.no_grad()
def complete(model, prompt, seq_len, device, limit=8):
    """The model's greedy continuation of prompt, up to the end of its line, on one rank."""
    ids = [VOCAB.index(c) for c in prompt]
    for _ in range(limit):
        context = torch.tensor([ids[-seq_len:]], device=device)
        logits = model(context, torch.arange(context.shape[1], device=device))
        ids.append(int(logits[0, -1].argmax()))
        if VOCAB[ids[-1]] == "\n":
            break
    return "".join(VOCAB[i] for i in ids[len(prompt):]).rstrip("\n")


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
def sum_gradients(model):
    """Sum every rank's gradients, in place, in one all-reduce of all of them: one message, not
    one per tensor (each a round trip; per tensor, --cp 4 on 2 cores spends most of a step here)."""
    grads = [param.grad for param in model.parameters()]
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat)
    for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


class Trainer:
    def __init__(self, model, train_loader, val_set, optimizer, device, args, rank, groups):
        self.model = model
        self.train_loader = train_loader
        self.val_set = val_set
        self.optimizer = optimizer
        self.device = device
        self.args = args
        self.save_every = args.save_every
        self.rank = rank
        self.is_main_process = rank == 0  # gates printing and writing: one copy, not N
        self.cp_group, self.dp_group = groups
        self.cp_rank = dist.get_rank(self.cp_group)  # which two chunks of each sequence
        # This rank's positions in every sequence: its two chunks (ring_attention.py).
        self.positions = local_part(torch.arange(args.seq_len, device=device), self.cp_rank,
                                    args.cp, dim=0)
        self.checkpoint_dir = os.path.join(args.out_dir, "checkpoint")
        self.epochs_completed = 0
        self.losses = []

    def loss_sum(self, batch):
        """The sum of this rank's tokens' losses: its two chunks of every sequence of its batch.
        The CP group's ranks read the same sequences and each keeps its own tokens."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(local_part(inputs, self.cp_rank, self.args.cp),
                            self.positions)
        return F.cross_entropy(logits.flatten(0, 1),
                               local_part(targets, self.cp_rank, self.args.cp).flatten(),
                               reduction="sum")

    def train_step(self, batch):
        """One step on the global batch: every rank's tokens' losses over all its tokens, and the
        gradients summed over every rank, so each rank steps with the whole batch's mean."""
        self.optimizer.zero_grad(set_to_none=True)
        tokens = self.args.batch_size * self.args.seq_len  # in the global batch
        loss_sum = self.loss_sum(batch)
        (loss_sum / tokens).backward()
        sum_gradients(self.model)  # every rank holds every weight: sum the shares
        self.optimizer.step()
        return loss_sum.detach()

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)  # else every epoch has the same order
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        for (batch,) in self.train_loader:
            totals[0] += self.train_step(batch.to(self.device))
            totals[1] += batch.shape[0] * self.args.seq_len / self.args.cp  # this rank's tokens
        dist.all_reduce(totals)  # every rank's tokens, counted once
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def validation_loss(self):
        """The mean loss over every validation token: each dp group a stride of the sequences,
        each CP rank its tokens of them; every rank calls the model (the ring needs them all)."""
        self.model.eval()
        dp_rank, dp = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        batch = self.val_set.tensors[0][dp_rank::dp].to(self.device)
        totals = torch.tensor([self.loss_sum(batch).item(),
                               batch.shape[0] * self.args.seq_len / self.args.cp],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    def training_state(self):
        """{"model": ..., "optimizer": ...}: tensors by parameter name (every rank the same)."""
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
                               "dp": self.args.dp, "cp": self.args.cp}, f)
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
        # needs now: the checkpoint loads whatever --dp and --cp wrote it.
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
                self.save_checkpoint()  # every rank takes part: dcp.save is a collective
        return self.losses


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def build_groups(dp, cp, timeout):
    """Rank r is CP rank r % cp of CP group r // cp. With --dp 2 --cp 2: CP groups [0, 1] and
    [2, 3] (the ring runs along them), dp groups [0, 2] and [1, 3] (the same chunks of different
    sequences)."""
    ranks = torch.arange(dp * cp).view(dp, cp)
    groups = {}
    # Every rank makes every group, in the same order, and keeps its own; each with --timeout.
    for name, lines in (("dp", ranks.T), ("cp", ranks)):
        for line in lines:
            group = dist.new_group(line.tolist(), timeout=datetime.timedelta(seconds=timeout))
            if dist.get_rank() in line:
                groups[name] = group
    return groups["cp"], groups["dp"]


def main(rank, local_rank, args):
    device = setup_process_group(rank, local_rank, args.world_size, args.backend, args.timeout)
    if args.float64:  # the proofs: float32 rounds each layout's sums apart, Adam amplifies it
        torch.set_default_dtype(torch.float64)
    train_set, val_set = load_data(args.seq_len)
    groups = build_groups(args.dp, args.cp, args.timeout)
    dp_rank = dist.get_rank(groups[1])
    train_loader = prepare_dataloader(train_set, args.batch_size // args.dp, args.seed, dp_rank,
                                      args.dp)
    # Seed before building the model so the initial weights are the same on every rank.
    torch.manual_seed(args.seed)
    model = TinyGPT(args.seq_len, args.dim, args.heads, args.layers).to(device)
    if args.cp > 1:
        model.use_cp_group(groups[0])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, val_set, optimizer, device, args, rank, groups)
    resumed_after_epoch = resume(trainer, rank, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): --dp {args.dp} "
              f"x --cp {args.cp}, {len(train_set)} train / {len(val_set)} validation sequences "
              f"of {args.seq_len} characters, {args.batch_size} per step", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    val_loss = trainer.validation_loss()
    if not trainer.is_main_process:
        return  # every rank holds the whole model: rank 0 alone writes and samples
    save_atomically({name: t.detach().cpu() for name, t in model.state_dict().items()},
                    os.path.join(args.out_dir, "final.pt"))
    model.use_cp_group(None)  # rank 0 alone, on whole sequences
    prompts = ["3+4=", "8+9=", "0+6="]
    samples = {p: complete(model, p, args.seq_len, device) for p in prompts}
    results = {"train_loss": losses, "val_loss": val_loss, "samples": samples,
               "train_seconds": train_seconds, "wall_seconds": time.time() - args.start_time}
    save_atomically(describe_run(args, device, resumed_after_epoch) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print("samples: " + " | ".join(f"{p}{s}" for p, s in samples.items()), flush=True)
    print(f"validation loss: {val_loss:.4f} | results in {args.out_dir}", flush=True)


def resume(trainer, rank, args):
    """Load the newest finished checkpoint in --out-dir, if any; return the epochs it holds."""
    # Automatic resume: a finished checkpoint in --out-dir means an earlier run got this far.
    # Rank 0 picks it for every rank, once each has shown it sees the folder (guard_rails.py).
    checkpoint = agree_on_checkpoint(rank, trainer.checkpoint_dir, latest_checkpoint)
    if checkpoint:
        progress = trainer.load_checkpoint(checkpoint)
        if trainer.is_main_process:
            print(f"resuming from {checkpoint}: {trainer.epochs_completed} of {args.epochs} "
                  f"epochs done, written by --dp {progress['dp']} --cp {progress['cp']}, "
                  f"loaded by --dp {args.dp} --cp {args.cp}", flush=True)
    if trainer.epochs_completed == args.epochs and trainer.is_main_process:
        print(f"note: {checkpoint} already holds all {args.epochs} epochs: nothing left to "
              "train; raise --epochs to train on, or choose another --out-dir to start afresh",
              flush=True)
    return trainer.epochs_completed


def describe_run(args, device, resumed_after_epoch):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": "11_context_parallel",
        "dp": args.dp,
        "cp": args.cp,
        "seq_len": args.seq_len,
        "dim": args.dim,
        "heads": args.heads,
        "layers": args.layers,
        "float64": args.float64,
        "world_size": args.world_size,
        "launcher": args.launcher,
        "resumed_after_epoch": resumed_after_epoch,
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
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
        check_context_parallel(args, load_data)  # --dp (default: WORLD_SIZE / --cp) x --cp
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        check_backends_agree(args.backend, args.timeout)  # every node chose the same one
        check_sharding(args, latest_checkpoint)
        worker(int(os.environ["LOCAL_RANK"]), args)  # runs main, then ends this process
        return
    args.launcher = "spawn"
    check_context_parallel(args, load_data)  # --seq-len in 2 x --cp chunks, a step for all
    args.world_size = args.dp * args.cp
    args.backend = choose_backend(args.backend, args.world_size, "--dp x --cp")
    check_sharding(args, latest_checkpoint)  # any checkpoint: the same model (guard rails)
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
        description="Lesson 11: train a tiny GPT with context parallelism (ring attention).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per step, in all (the global batch, split over --dp)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default="runs/11_context_parallel",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--cp", type=int, default=2,
                        help="ranks that split each sequence (a CP group: the ring)")
    parser.add_argument("--dp", type=int,
                        help="CP groups that read different sequences (default: torchrun's "
                        "ranks / --cp; else as many groups of --cp GPUs as --batch-size splits "
                        "over, at least 1)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=32, help="the model's width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--float64", action="store_true",
                        help="compute in float64: the layouts then agree to ~1e-14 after 2 epochs")
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
