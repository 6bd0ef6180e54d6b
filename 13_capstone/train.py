"""Lesson 13, the capstone: one tiny GPT trained with FSDP x TP x PP on one device mesh.

Lesson 11's program, its tiny GPT now trained with three kinds of parallelism at once, each a
dimension of one (pp, dp, tp) mesh of ranks (parallelize.py, read it first): --pp stages each
keep their share of the blocks (lesson 10), --tp ranks split each stage's weights by heads and by
hidden units, with the sequence split over them between (lesson 09), and --dp copies of that
pipeline read different sequences, their weights sharded by FSDP (lesson 07). The default,
--dp 2 --pp 2 --tp 2, is 8 ranks: a small cluster's layout, on a laptop. Every layout takes one
process's steps; the checkpoint loads into any layout, and into one process.

Run it (each run its own --out-dir, or it resumes the finished checkpoint of the one before):
    python 13_capstone/train.py                                            # 8 ranks: 2 x 2 x 2
    python 13_capstone/train.py --dp 1 --pp 1 --tp 1 --out-dir runs/13_one  # one process
    torchrun --standalone --nproc-per-node 4 13_capstone/train.py --pp 2 --tp 2 --out-dir runs/13_t
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
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from guard_rails import (
    agree_on_checkpoint,
    check_args,
    check_backends_agree,
    check_layout,
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
from parallelize import (
    build_mesh,
    clip_whole_model,
    keep_stage,
    pipeline_schedule,
    shard_data_parallel,
    tensor_parallel,
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
    """mp.spawn(fn, args, nprocs), each rank forked from a server that has imported torch once,
    not a fresh Python that imports it again (lesson 02's README)."""
    if sys.platform != "linux":  # macOS and Windows: spawn, Python's default there
        return mp.spawn(fn, args=args, nprocs=nprocs)
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint",
                               "torch.distributed.fsdp", "torch.distributed.pipelining"])
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
# Model: a tiny GPT, cut into stages
# ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal self-attention, with q, k and v each its own layer: TP splits each by its output
    columns, whole heads to a rank (lesson 11's one qkv layer, split so, would give the first
    rank all of q and none of v)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        # No bias on q, k, v: a key bias adds q . b to all of a query's scores, which softmax
        # cancels, so its gradient is 0 but for rounding, and Adam turns rounding into steps.
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, _ = x.shape
        # -1 heads: the ones this rank holds, all of them on one process, heads / tp under TP
        q, k, v = (f(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, -1))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    """Characters -> embeddings (of the character and of its position) -> pre-norm blocks ->
    a score for every next character. A pipeline stage is this model with some parts deleted
    (keep_stage): its forward runs the parts it has."""

    def __init__(self, seq_len, dim=32, heads=4, layers=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(len(VOCAB), dim), nn.Embedding(seq_len, dim)
        # A dict, not a list: blocks.2 keeps its name on the stage that holds it alone
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, len(VOCAB))

    def forward(self, x):
        if self.tokens is not None:  # the first stage: characters in
            x = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:  # the last stage: scores out
            x = self.head(self.norm(x))
        return x


@torch.no_grad()
def complete(model, prompt, seq_len, device, limit=8):
    """The model's greedy continuation of prompt, up to the end of its line, on one rank."""
    ids = [VOCAB.index(c) for c in prompt]
    for _ in range(limit):
        logits = model(torch.tensor([ids[-seq_len:]], device=device))
        ids.append(int(logits[0, -1].argmax()))
        if VOCAB[ids[-1]] == "\n":
            break
    return "".join(VOCAB[i] for i in ids[len(prompt):]).rstrip("\n")


@torch.no_grad()
def validation_loss(model, val_set, device):
    """The mean loss over every validation token, on one process's model."""
    batch = val_set.tensors[0].to(device)
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def evaluate(model, val_set, seq_len, device):
    """One process's model: its validation loss, and its continuations of three sums."""
    return validation_loss(model, val_set, device), {
        prompt: complete(model, prompt, seq_len, device) for prompt in ("3+4=", "8+9=", "0+6=")}


def parallelize(model, mesh, device, args):
    """This rank's part of the model, in the order that works (parallelize.py): its stage, split
    by TP, sharded by FSDP, in a pipeline schedule."""
    tokens = args.batch_size // args.dp * args.seq_len  # this dp rank's, in each step

    def loss_fn(logits, targets):
        # Each micro-batch's share of the mean over this dp rank's tokens; FSDP then averages
        # the dp ranks' gradients, so each step takes the whole global batch's mean.
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens

    keep_stage(model, mesh["pp"].get_local_rank(), args.pp)
    if args.tp > 1:
        tensor_parallel(model, mesh["tp"])
    shard_data_parallel(model, mesh["dp"])
    return pipeline_schedule(model, mesh, device, args.schedule, args.microbatches, loss_fn)


def whole_model(model, args, mesh):
    """One process's model, on every rank: each stage's weights gathered whole over its dp and tp
    ranks (full_tensor), then every stage's over the pipeline (a few hundred kilobytes here)."""
    mine = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
            for name, t in model.state_dict().items()}
    stages = [None] * args.pp
    dist.all_gather_object(stages, mine, group=mesh["pp"].get_group())
    whole = TinyGPT(args.seq_len, args.dim, args.heads, args.layers)
    whole.load_state_dict({name: t for stage in stages for name, t in stage.items()})
    return whole


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, schedule, train_loader, optimizer, device, args, rank, mesh):
        self.model = model
        self.schedule = schedule
        self.train_loader = train_loader
        self.optimizer = optimizer
        self.device = device
        self.args = args
        self.save_every = args.save_every
        self.rank = rank
        self.is_main_process = rank == 0  # gates printing and writing: one copy, not N
        self.pp_group = mesh["pp"].get_group()
        self.first = mesh["pp"].get_local_rank() == 0
        self.last = mesh["pp"].get_local_rank() == args.pp - 1
        # The last stage's ranks know the loss; one per TP group counts it, once.
        self.counts_loss = self.last and mesh["tp"].get_local_rank() == 0
        self.checkpoint_dir = os.path.join(args.out_dir, "checkpoint")
        self.epochs_completed = 0
        self.losses = []

    def train_step(self, batch):
        """One step on this dp rank's sequences, micro-batch by micro-batch through the stages:
        the first stage feeds the characters in, the last compares its scores with the targets.
        Returns the sum of the losses of this rank's tokens (0 but on the last stage)."""
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        self.schedule.step(*[batch[:, :-1]] if self.first else [],
                           target=batch[:, 1:] if self.last else None, losses=losses)
        clip_whole_model(self.model.parameters(), self.args.max_norm, self.pp_group)
        self.optimizer.step()
        tokens = batch.shape[0] * self.args.seq_len
        return sum(loss.detach() for loss in losses) * tokens if losses else 0.0

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)  # else every epoch has the same order
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        for (batch,) in self.train_loader:
            loss_sum = self.train_step(batch.to(self.device))
            if self.counts_loss:
                totals[0] += loss_sum
                totals[1] += batch.shape[0] * self.args.seq_len
        dist.all_reduce(totals)  # every dp rank's tokens, counted once
        return (totals[0] / totals[1]).item()

    def training_state(self):
        """{"model": ..., "optimizer": ...}: tensors by parameter name, each rank its pieces."""
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
                               "dp": self.args.dp, "pp": self.args.pp, "tp": self.args.tp}, f)
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
        # needs now: the checkpoint loads whatever --dp, --pp and --tp wrote it.
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
def main(rank, local_rank, args):
    device = setup_process_group(rank, local_rank, args.world_size, args.backend, args.timeout)
    if args.float64:  # the proofs: float32 rounds each layout's sums apart, Adam amplifies it
        torch.set_default_dtype(torch.float64)
    train_set, val_set = load_data(args.seq_len)
    mesh = build_mesh(device.type, args.dp, args.pp, args.tp, args.timeout)
    # Each dp rank reads its own sequences; the pp and tp ranks of one pipeline, the same ones.
    train_loader = prepare_dataloader(train_set, args.batch_size // args.dp, args.seed,
                                      mesh["dp"].get_local_rank(), args.dp)
    # Seed before building the model so the initial weights are the same on every rank.
    torch.manual_seed(args.seed)
    model = TinyGPT(args.seq_len, args.dim, args.heads, args.layers).to(device)
    schedule = parallelize(model, mesh, device, args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, schedule, train_loader, optimizer, device, args, rank, mesh)
    resumed_after_epoch = resume(trainer, rank, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): --dp {args.dp} "
              f"x --pp {args.pp} x --tp {args.tp}, {len(train_set)} train / {len(val_set)} "
              f"validation sequences of {args.seq_len} characters, {args.batch_size} per step",
              flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    every = [None] * args.world_size  # what each rank holds, for the table in metrics.json
    dist.all_gather_object(every, bytes_held(model, optimizer))
    whole = whole_model(model, args, mesh)
    if not trainer.is_main_process:
        return  # rank 0 alone writes and samples
    save_atomically(whole.state_dict(), os.path.join(args.out_dir, "final.pt"))
    val_loss, samples = evaluate(whole.to(device), val_set, args.seq_len, device)
    steps = (args.epochs - resumed_after_epoch) * len(train_loader)
    results = {"train_loss": losses, "val_loss": val_loss, "samples": samples,
               "bytes_per_rank": every, "train_seconds": train_seconds,
               "tokens_per_second": steps * args.batch_size * args.seq_len / train_seconds,
               "wall_seconds": time.time() - args.start_time}
    save_atomically(describe_run(args, device, resumed_after_epoch) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print("samples: " + " | ".join(f"{p}{s}" for p, s in samples.items()), flush=True)
    print(f"validation loss: {val_loss:.4f} | results in {args.out_dir}", flush=True)


def bytes_held(model, optimizer):
    """What this rank holds, in bytes: its pieces of the weights, of their gradients (from the
    last step) and of Adam's two running averages."""
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {"weights": local_bytes(model.parameters()),
            "gradients": local_bytes(p.grad for p in model.parameters()),
            "optimizer": local_bytes(state)}


def resume(trainer, rank, args):
    """Load the newest finished checkpoint in --out-dir, if any; return the epochs it holds."""
    # Automatic resume: a finished checkpoint in --out-dir means an earlier run got this far.
    # Rank 0 picks it for every rank, once each has shown it sees the folder (guard_rails.py).
    checkpoint = agree_on_checkpoint(rank, trainer.checkpoint_dir, latest_checkpoint)
    if checkpoint:
        progress = trainer.load_checkpoint(checkpoint)
        if trainer.is_main_process:
            print(f"resuming from {checkpoint}: {trainer.epochs_completed} of {args.epochs} "
                  f"epochs done, written by {layout(progress)}, loaded by {layout(vars(args))}",
                  flush=True)
    if trainer.epochs_completed == args.epochs and trainer.is_main_process:
        print(f"note: {checkpoint} already holds all {args.epochs} epochs: nothing left to "
              "train; raise --epochs to train on, or choose another --out-dir to start afresh",
              flush=True)
    return trainer.epochs_completed


def layout(settings):
    return " ".join(f"--{name} {settings[name]}" for name in ("dp", "pp", "tp"))


def describe_run(args, device, resumed_after_epoch):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": "13_capstone",
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
        check_layout(args)  # --dp (default: WORLD_SIZE / (--pp x --tp)) x --pp x --tp = WORLD_SIZE
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        check_backends_agree(args.backend, args.timeout)  # every node chose the same one
        check_sharding(args, latest_checkpoint)
        worker(int(os.environ["LOCAL_RANK"]), args)  # runs main, then ends this process
        return
    args.launcher = "spawn"
    check_layout(args)  # the model splits over this layout: heads, layers, tokens, batch
    args.world_size = args.dp * args.pp * args.tp
    args.backend = choose_backend(args.backend, args.world_size, "--dp x --pp x --tp")
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
        description="Lesson 13: train a tiny GPT with FSDP x TP x PP on one device mesh.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per step, in all (the global batch, split over --dp)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--max-norm", type=float, default=1.0,
                        help="clip the gradients to this norm, the whole model's")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=5,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default="runs/13_capstone",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages, each its blocks")
    parser.add_argument("--tp", type=int, default=2,
                        help="ranks that split each stage's weights (a TP group)")
    parser.add_argument("--dp", type=int,
                        help="pipelines that read different sequences, their weights sharded "
                        "by FSDP (default: torchrun's ranks / (--pp x --tp); else the most "
                        "pipelines the GPUs hold that --batch-size splits over; without enough "
                        "GPUs, 2)")
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
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
