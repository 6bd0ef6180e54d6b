"""Lesson 06: DDP in practice: mixed precision, gradient accumulation, clipping, torch.compile.

Lesson 02's program, with what a DDP script for a real model adds: bf16 or fp16 autocast,
gradient accumulation with one all-reduce per step (no_sync), clipping of the synchronised
gradient, torch.compile, a learning rate for the global batch with a warm-up, and torchrun.

Run it:
    python 06_ddp_in_practice/train.py                                 # every GPU, or 2 CPU ranks
    python 06_ddp_in_practice/train.py --precision bf16 --compile      # compile: a C++ compiler
    python 06_ddp_in_practice/train.py --accumulate 4 --clip-grad-norm 1 --scale-lr sqrt
    torchrun --standalone --nproc-per-node 2 06_ddp_in_practice/train.py   # torchrun, one machine
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        06_ddp_in_practice/train.py          # on machine 0; on machine 1 with --node-rank 1
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import guard_rails
from data import load_data
from learning_rate import lr_at_step, scaled_lr
from model import WineMLP


# ---------------------------------------------------------------------------------------------
# The lesson: the training step, and how the data and the model come in
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir,
                 micro_batch, precision, clip_grad_norm, lr_schedule):
        self.model = model
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # from the group
        self.is_main_process = self.rank == 0  # gates printing and writing: one copy, not N
        self.micro_batch = micro_batch  # samples per forward and backward: --batch-size
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        # fp16 cannot hold gradients below about 6e-8 (they become 0): the scaler multiplies the
        # loss, divides the gradients back, skips a step that overflowed. bf16 needs none.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.clip_grad_norm = clip_grad_norm or math.inf  # inf: measure the norm, clip nothing
        self.lr_schedule = lr_schedule
        self.steps, self.lrs = 0, []  # optimizer steps taken, and the rate each one used
        self.grad_norms = []  # the global gradient's norm before clipping, at every step

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_schedule(self.steps)
        # Gradient accumulation: forward and backward one micro-batch at a time (the activations
        # of one micro-batch in memory, not of the step's batch); the gradients add up in .grad.
        micro_batches = list(zip(features.split(self.micro_batch), labels.split(self.micro_batch),
                                 strict=True))
        step_loss = 0.0
        for i, (x, y) in enumerate(micro_batches):
            # Inside no_sync DDP's backward skips its all-reduce, and the last backward
            # all-reduces the sum. no_sync must hold the forward too: DDP prepares it there.
            with contextlib.nullcontext() if i == len(micro_batches) - 1 else self.model.no_sync():
                # Autocast: matrix products in bf16 or fp16, ops that need range (softmax, the
                # loss) in fp32; backward follows suit. Weights, .grad, Adam's state stay fp32.
                with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):
                    # Weighted by its share of the step's samples (1/K for K equal micro-batches),
                    # the gradients sum to the step's mean loss's; unweighted, K times that.
                    loss = F.cross_entropy(self.model(x), y) * len(y) / len(labels)
                self.scaler.scale(loss).backward()
            step_loss += loss.detach().float()
        self.scaler.unscale_(self.optimizer)  # fp16: the true gradients, before their norm
        # After the all-reduce every rank holds the global batch's gradient: all measure the same
        # norm and clip alike (inside no_sync each would clip its own part, by its own factor).
        self.grad_norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                              self.clip_grad_norm))
        self.lrs.append(self.optimizer.param_groups[0]["lr"])  # what the step below uses
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.steps += 1
        return step_loss

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
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank's slice: the mean over all
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """Count correct predictions over the whole test set."""
        self.model.eval()
        # A stride: each test wine on exactly one rank (DistributedSampler would pad with repeats).
        features = self.test_set.features[self.rank::self.world_size].to(self.device)
        labels = self.test_set.labels[self.rank::self.world_size].to(self.device)
        # The model inside DDP (.module): evaluation needs none of DDP's synchronisation.
        predictions = self.model.module(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return int(counts[0]), int(counts[1])

    def save_checkpoint(self, epoch):
        # The model inside DDP (.module): keys without a "module." prefix, as lesson 01 loads.
        checkpoint = {"model": self.model.module.state_dict(), "epochs_completed": epoch + 1}
        save_atomically(checkpoint, os.path.join(self.out_dir, "checkpoint.pt"))

    def train(self, max_epochs):
        losses = []
        for epoch in range(max_epochs):
            start = time.perf_counter()
            loss = self.train_epoch(epoch)
            losses.append(loss)
            if self.is_main_process:
                print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                      f"| {time.perf_counter() - start:.3f} s", flush=True)
            if self.is_main_process and (epoch + 1) % self.save_every == 0:
                self.save_checkpoint(epoch)
        return losses


def prepare_dataloader(dataset, batch_size, seed, rank, world_size):
    # Each rank gets a disjoint slice of one seeded shuffle, padded with repeats so that all
    # run the same number of steps (one step fewer would leave the others waiting forever).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def build_model(args, device):
    """The wine MLP, on this rank's device, in DDP."""
    # Seed before building the model so the initial weights are the same on every run.
    torch.manual_seed(args.seed)
    model = WineMLP().to(device)
    # DDP copies rank 0's weights to every rank; device_ids: this rank's GPU (none on a CPU).
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        # Compile the DDP model, not the module inside: Dynamo's DDPOptimizer then splits the
        # graph where DDP's gradient buckets end, so that each bucket's all-reduce can start
        # while backward goes on (this MLP fits in one bucket). The first steps pay to compile.
        model = torch.compile(model)
    return model


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, args.world_size, args.backend, args.timeout)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size * args.accumulate, args.seed,
                                      rank, args.world_size)

    model = build_model(args, device)
    global_batch = args.batch_size * args.accumulate * args.world_size  # samples per step
    peak_lr = scaled_lr(args.lr, global_batch, args.scale_lr)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, args.batch_size, args.precision, args.clip_grad_norm,
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
    grad_norms = [None] * args.world_size  # every rank's, to show that all clip alike
    dist.all_gather_object(grad_norms, torch.stack(trainer.grad_norms).tolist())
    if not trainer.is_main_process:
        return  # every rank holds the same results; rank 0 alone writes them
    samples_per_second = args.epochs * len(train_loader.sampler) * args.world_size / train_seconds
    print(f"{samples_per_second:.0f} samples/s over all ranks, {trainer.steps} optimizer steps",
          flush=True)
    save_atomically(cpu_state_dict(model.module), os.path.join(args.out_dir, "final.pt"))
    results = {"samples_per_second": samples_per_second,
               "train_loss": losses, "test_correct": correct, "test_total": total,
               "test_accuracy": correct / total, "train_seconds": train_seconds,
               "wall_seconds": time.time() - start}
    save_atomically(describe_run(args, device, global_batch, trainer, grad_norms) | results,
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
    # torchrun numbers the GPUs and shares the cores per node; mp.spawn's ranks are all on this
    # one. Read only under torchrun: some clusters export LOCAL_RANK to every process.
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
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        return worker(int(os.environ["LOCAL_RANK"]), main, args)
    args.backend = choose_backend(args.backend, args.world_size)
    # Rank 0 listens on this machine: a MASTER_PORT already set wins, else any free port.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(guard_rails.find_free_port()))
    print(f"starting {args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # mp.spawn(worker, args=(main, args), nprocs=args.world_size): ranks 0 .. world_size - 1,
    # each forked from a server that has imported torch and these once (lesson 02's README).
    preload = ["torch._dynamo", "sklearn.datasets", "sklearn.model_selection",
               "sklearn.preprocessing"]
    with guard_rails.spawn_guard("rank"):
        guard_rails.start_ranks(worker, (main, args), args.world_size, preload)


def cpu_state_dict(model):
    # As CPU tensors the weights load on any machine as they are, with a GPU or without.
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


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


LESSON = os.path.basename(os.path.dirname(os.path.abspath(__file__)))  # this folder's name


def describe_run(args, device, global_batch, trainer, grad_norms):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": LESSON,
        "world_size": args.world_size,
        "backend": args.backend,
        "device": device.type,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        **vars(args),  # every flag, this lesson's among them
        "global_batch": global_batch,
        "optimizer_steps": trainer.steps,
        "lr_per_step": trainer.lrs,  # the warm-up and --scale-lr, as the optimizer got them
        "grad_scale": trainer.scaler.get_scale(),  # fp16's loss scale at the end; else 1
        "grad_norms": grad_norms,  # per rank: the global gradient's norm at every step
        "seed": args.seed,
        "threads_per_rank": torch.get_num_threads(),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.partition("\n")[0],  # the docstring's first line
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch size, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write checkpoint.pt every N epochs")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for checkpoint.pt, final.pt and metrics.json")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() or 2,
                        help="number of processes (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="autocast dtype of forward and backward; fp16 only on GPUs")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--clip-grad-norm", type=float, default=0.0,
                        help="clip the global gradient norm to this (0: measure, do not clip)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--scale-lr", choices=["linear", "sqrt"],
                        help="rule that scales --lr, chosen for batch 32, to the global batch")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="steps over which the lr rises from --lr to the scaled one")
    return guard_rails.check_practice_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
