"""Lesson 12: expert parallelism, a mixture of experts whose experts live on different ranks.

Lesson 11's program, with every block's MLP replaced by --experts experts and a router that
sends each token to --top-k of them (experts.py, read it first). --ep N ranks share the experts
out: each step, every rank sends each of its tokens to the ranks of its experts and gets the
results back, by two all-to-alls. The ranks read different sequences, so the weights outside the
experts are data parallel over every rank; --dp M groups of N ranks hold copies of each expert.
Every layout takes one process's steps: --batch-size is the global batch, sequences per step.
The sequences are whole again (no --cp; lesson 13 combines FSDP, TP and PP, and leaves CP and
EP out). The checkpoint is lesson 11's, and loads into any --dp and --ep.

Run it (each run its own --out-dir, or it resumes the finished checkpoint of the one before):
    python 12_expert_parallel/train.py --ep 1 --out-dir runs/12_one     # one process
    python 12_expert_parallel/train.py                                  # EP on 2 ranks
    python 12_expert_parallel/train.py --dp 2 --ep 2 --out-dir runs/12_2d
    torchrun --standalone --nproc-per-node 4 12_expert_parallel/train.py --ep 4 --out-dir runs/12_t
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

from experts import MoE
from guard_rails import (
    agree_on_checkpoint,
    check_args,
    check_backends_agree,
    check_expert_parallel,
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
    """Causal self-attention, on whole sequences: torch's scaled_dot_product_attention, which
    computes what lesson 11's attend_block does (softmax(q k^T / sqrt(head dim)) v, each query
    seeing the keys up to its own) without the ring_attention.py this lesson has no use for."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        # No bias on q, k, v: a key bias adds q . b to all of a query's scores, which softmax
        # cancels, so its gradient is 0 but for rounding, and Adam turns rounding into steps.
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim, heads, moe):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, *moe)  # in place of lesson 11's MLP

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class TinyGPT(nn.Module):
    """Characters -> embeddings (of the character and of its position) -> pre-norm blocks ->
    a score for every next character."""

    def __init__(self, seq_len, dim=32, heads=4, layers=2, moe=(4, 2, 0)):
        """moe: (experts, top_k, capacity_factor) of every block's MoE layer."""
        super().__init__()
        self.tokens, self.positions = nn.Embedding(len(VOCAB), dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, moe) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, len(VOCAB))

    def forward(self, ids):
        """ids: [batch, tokens] characters."""
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def hold_experts(self, group):
        """Keep this rank's share of every block's experts (experts.py)."""
        for block in self.blocks:
            block.moe.hold_experts(group)

    def balance_and_load(self):
        """The last forward's balance loss, summed over the blocks, and its rows per expert:
        [blocks, experts]."""
        moes = [block.moe for block in self.blocks]
        return sum(moe.balance for moe in moes), torch.stack([moe.load for moe in moes])


@torch.no_grad()
def complete(model, prompt, seq_len, device, limit=8):
    """The model's greedy continuation of prompt, up to the end of its line, on one rank."""
    ids = [VOCAB.index(c) for c in prompt]
    for _ in range(limit):
        context = torch.tensor([ids[-seq_len:]], device=device)
        logits = model(context)
        ids.append(int(logits[0, -1].argmax()))
        if VOCAB[ids[-1]] == "\n":
            break
    return "".join(VOCAB[i] for i in ids[len(prompt):]).rstrip("\n")


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
def sum_gradients(params, group):
    """Sum the gradients of params over the ranks of group, in place, in one all-reduce of all
    of them: one message, not one per tensor (each a round trip)."""
    grads = [param.grad for param in params]
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


def describe_load(load, args):
    """load: [steps, blocks, experts], rows per expert. How much more than an even share the
    busiest expert got, and the busiest rank of an EP group (the rows of its --experts / --ep
    experts: the others wait for it), in the block where it is most; and the share of the
    choices dropped by the capacity limit. With --dp > 1, load is summed over the EP groups."""
    per_expert = load.sum(dim=0).to(torch.float64)  # [blocks, experts]
    per_rank = per_expert.view(len(per_expert), args.ep, -1).sum(dim=2)  # [blocks, EP ranks]
    expert, rank = ((rows.max(dim=1).values / rows.mean(dim=1)).max()
                    for rows in (per_expert, per_rank))
    choices = load.shape[0] * args.batch_size * args.seq_len * args.top_k * load.shape[1]
    return (f"busiest expert {expert:.2f}x its share, busiest rank {rank:.2f}x, "
            f"{1 - per_expert.sum() / choices:.1%} dropped")


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
        self.ep_group, self.dp_group = groups
        # Every rank holds the weights outside the experts; an expert, the ranks of the dp group.
        self.dense = [p for name, p in model.named_parameters() if ".experts." not in name]
        self.experts = [p for name, p in model.named_parameters() if ".experts." in name]
        self.checkpoint_dir = os.path.join(args.out_dir, "checkpoint")
        self.epochs_completed = 0
        self.losses = []
        self.load = []  # every step's rows per expert, summed over the ranks: [blocks, experts]

    def loss_sums(self, batch):
        """The sum of the losses of this rank's tokens, and of its sequences' balance losses."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(inputs)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return loss_sum, self.model.balance_and_load()[0]

    def train_step(self, batch):
        """One step on the global batch: the mean over all its tokens (and sequences, of the
        balance loss), its gradients summed over the ranks that hold each weight."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, balance_sum = self.loss_sums(batch)
        tokens = self.args.batch_size * self.args.seq_len  # in the global batch
        (loss_sum / tokens + self.args.balance_loss * balance_sum / self.args.batch_size).backward()
        sum_gradients(self.dense, None)  # every rank holds these: sum every rank's share
        sum_gradients(self.experts, self.dp_group)  # each expert: its copies on the dp group
        self.optimizer.step()
        return loss_sum.detach()

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)  # else every epoch has the same order
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        load = []
        for (batch,) in self.train_loader:
            totals[0] += self.train_step(batch.to(self.device))
            totals[1] += batch.numel() - batch.shape[0]  # this rank's tokens
            load.append(self.model.balance_and_load()[1])
        dist.all_reduce(totals)  # every rank's tokens, counted once
        load = torch.stack(load)
        dist.all_reduce(load)  # every rank's rows per expert, step by step
        self.load += load.tolist()
        return (totals[0] / totals[1]).item(), load

    @torch.no_grad()
    def validation_loss(self):
        """The mean loss over every validation token: each rank a stride of the sequences; every
        rank calls the model (the experts' exchanges need them all)."""
        self.model.eval()
        batch = self.val_set.tensors[0][self.rank::dist.get_world_size()].to(self.device)
        totals = torch.tensor([self.loss_sums(batch)[0].item(), batch.numel() - batch.shape[0]],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    def training_state(self):
        """{"model": ..., "optimizer": ...}: tensors by parameter name, as one process names
        them: the weights outside the experts (every rank the same), and this rank's experts."""
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
                           "expert_load": self.load, "dp": self.args.dp, "ep": self.args.ep}, f)
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
        # needs now (its experts by their names): the checkpoint loads whatever --dp and --ep
        # wrote it.
        state = self.training_state()
        dcp.load(state, checkpoint_id=path)
        _, optimizer_state = get_state_dict(self.model, self.optimizer)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={**optimizer_state, "state": state["optimizer"]})
        self.epochs_completed = progress["epochs_completed"]
        self.losses = list(progress["train_loss"])
        self.load = list(progress["expert_load"])
        return progress

    def train(self, max_epochs):
        # From the checkpoint's next epoch, not from 0: no epoch is repeated or skipped.
        for epoch in range(self.epochs_completed, max_epochs):
            start = time.perf_counter()
            loss, load = self.train_epoch(epoch)
            self.losses.append(loss)
            self.epochs_completed = epoch + 1
            if self.is_main_process:
                print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                      f"| {describe_load(load, self.args)} | {time.perf_counter() - start:.3f} s",
                      flush=True)
            if self.epochs_completed % self.save_every == 0 or self.epochs_completed == max_epochs:
                self.save_checkpoint()  # every rank takes part: dcp.save is a collective
        return self.losses


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def build_groups(dp, ep, timeout):
    """Rank r is EP rank r % ep of EP group r // ep. With --dp 2 --ep 2: EP groups [0, 1] and
    [2, 3] (each holds every expert once), dp groups [0, 2] and [1, 3] (the copies of the same
    experts)."""
    ranks = torch.arange(dp * ep).view(dp, ep)
    groups = {}
    # Every rank makes every group, in the same order, and keeps its own; each with --timeout.
    for name, lines in (("dp", ranks.T), ("ep", ranks)):
        for line in lines:
            group = dist.new_group(line.tolist(), timeout=datetime.timedelta(seconds=timeout))
            if dist.get_rank() in line:
                groups[name] = group
    return groups["ep"], groups["dp"]


def whole_model(model, args, ep_group):
    """One process's model, every expert in it, on every rank of ep_group: its ranks' experts
    gathered (a few kilobytes here), for final.pt and for rank 0 to sample from."""
    mine = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    every = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(every, {n: t for n, t in mine.items() if ".experts." in n},
                           group=ep_group)
    whole = TinyGPT(args.seq_len, args.dim, args.heads, args.layers, moe_settings(args))
    whole.load_state_dict({n: t for part in [mine, *every] for n, t in part.items()})
    return whole


def moe_settings(args):
    return args.experts, args.top_k, args.capacity_factor


def main(rank, local_rank, args):
    device = setup_process_group(rank, local_rank, args.world_size, args.backend, args.timeout)
    if args.float64:  # the proofs: float32 rounds each layout's sums apart, Adam amplifies it
        torch.set_default_dtype(torch.float64)
    train_set, val_set = load_data(args.seq_len)
    groups = build_groups(args.dp, args.ep, args.timeout)
    # Every rank reads different sequences: --batch-size / (--dp x --ep) of them each step.
    train_loader = prepare_dataloader(train_set, args.batch_size // args.world_size, args.seed,
                                      rank, args.world_size)
    # Seed before building the model so the initial weights are the same on every rank.
    torch.manual_seed(args.seed)
    model = TinyGPT(args.seq_len, args.dim, args.heads, args.layers, moe_settings(args))
    model.hold_experts(groups[0])  # then keep this rank's experts
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, val_set, optimizer, device, args, rank, groups)
    resumed_after_epoch = resume(trainer, rank, args)  # 0: this run started from scratch
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): --dp {args.dp} "
              f"x --ep {args.ep}, {args.experts} experts ({args.experts // args.ep} per rank), "
              f"top-{args.top_k}, {len(train_set)} train / {len(val_set)} validation sequences "
              f"of {args.seq_len} characters, {args.batch_size} per step", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    val_loss = trainer.validation_loss()
    whole = whole_model(model, args, groups[0])
    if not trainer.is_main_process:
        return  # rank 0 alone writes and samples
    save_atomically({name: t.detach().cpu() for name, t in whole.state_dict().items()},
                    os.path.join(args.out_dir, "final.pt"))
    prompts = ["3+4=", "8+9=", "0+6="]
    samples = {p: complete(whole.to(device), p, args.seq_len, device) for p in prompts}
    results = {"train_loss": losses, "val_loss": val_loss, "samples": samples,
               "expert_load": trainer.load, "train_seconds": train_seconds,
               "wall_seconds": time.time() - args.start_time}
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
                  f"epochs done, written by --dp {progress['dp']} --ep {progress['ep']}, "
                  f"loaded by --dp {args.dp} --ep {args.ep}", flush=True)
    if trainer.epochs_completed == args.epochs and trainer.is_main_process:
        print(f"note: {checkpoint} already holds all {args.epochs} epochs: nothing left to "
              "train; raise --epochs to train on, or choose another --out-dir to start afresh",
              flush=True)
    return trainer.epochs_completed


def describe_run(args, device, resumed_after_epoch):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": "12_expert_parallel",
        "dp": args.dp,
        "ep": args.ep,
        "experts": args.experts,
        "top_k": args.top_k,
        "capacity_factor": args.capacity_factor,
        "balance_loss": args.balance_loss,
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
        check_expert_parallel(args, load_data)  # --dp (default: WORLD_SIZE / --ep) x --ep
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        check_backends_agree(args.backend, args.timeout)  # every node chose the same one
        check_sharding(args, latest_checkpoint)
        worker(int(os.environ["LOCAL_RANK"]), args)  # runs main, then ends this process
        return
    args.launcher = "spawn"
    check_expert_parallel(args, load_data)  # --experts over --ep, a step for every rank
    args.world_size = args.dp * args.ep
    args.backend = choose_backend(args.backend, args.world_size, "--dp x --ep")
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
        description="Lesson 12: train a tiny mixture-of-experts GPT with expert parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per step, in all (the global batch, split over --dp)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write a checkpoint every N epochs")
    parser.add_argument("--out-dir", default="runs/12_expert_parallel",
                        help="folder for checkpoint/, final.pt and metrics.json")
    parser.add_argument("--ep", type=int, default=2,
                        help="ranks that share the experts out (an EP group)")
    parser.add_argument("--dp", type=int,
                        help="EP groups, each with every expert (default: torchrun's ranks "
                        "/ --ep; else as many groups of --ep GPUs as --batch-size splits over, "
                        "at least 1)")
    parser.add_argument("--experts", type=int, default=4, help="experts in every block")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token goes to")
    parser.add_argument("--capacity-factor", type=float, default=0,
                        help="the most tokens an expert takes from a sequence, as a multiple "
                        "of its even share (tokens x top-k / experts); 0: no limit")
    parser.add_argument("--balance-loss", type=float, default=0.01,
                        help="weight of the Switch Transformer's load-balancing loss; 0: off")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=32, help="the model's width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--float64", action="store_true",
                        help="compute in float64: the layouts then agree to ~1e-12 after 2 epochs")
    return check_args(parser.parse_args(argv))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
