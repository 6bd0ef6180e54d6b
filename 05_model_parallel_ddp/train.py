"""Lesson 05: DDP over a model split across two devices per process (model parallelism).

Lesson 02's program, with each rank's model cut in two (model.py): fc1 and its ReLU on one
device, fc2 on another. With 2k GPUs, k ranks own two GPUs each (rank r: GPUs 2r and 2r+1).
DistributedDataParallel (DDP) averages their gradients, so every rank takes the same step.

Run it:
    python 05_model_parallel_ddp/train.py                          # GPU pairs, or 2 CPU ranks
    python 05_model_parallel_ddp/train.py --backend gloo           # force the CPU even with GPUs
    CUDA_VISIBLE_DEVICES=0,1 python 05_model_parallel_ddp/train.py # one rank over GPUs 0 and 1
    torchrun --standalone --nproc-per-node 2 05_model_parallel_ddp/train.py  # no mp.spawn
"""

import argparse
import datetime
import json
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
from model import WineMLP


# ---------------------------------------------------------------------------------------------
# The lesson: the training step, and how the data and the model come in
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir):
        self.model = model
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # from the group
        self.is_main_process = self.rank == 0  # gates printing and writing: one copy, not N

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(features)  # on dev1, where the labels must go too
        loss = F.cross_entropy(output, labels.to(output.device))
        # In backward, DDP all-reduces the gradients and divides by world_size: the mean of the
        # ranks' batch means is the global batch's mean gradient, the same step on every rank.
        loss.backward()
        self.optimizer.step()
        return loss.detach().to(self.device)  # back to dev0, where the running totals are

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
        predictions = predictions.to(self.device)  # from dev1, to the labels on dev0
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return int(counts[0]), int(counts[1])

    def save_checkpoint(self, epoch):
        # The model inside DDP (.module): keys without a "module." prefix, as lesson 01 loads.
        checkpoint = {"model": cpu_state_dict(self.model.module), "epochs_completed": epoch + 1}
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


def build_model(args, dev0, dev1):
    """The wine MLP split over this rank's two devices, in DDP."""
    # Seed before building the model so the initial weights are the same on every run.
    torch.manual_seed(args.seed)
    model = WineMLP(dev0, dev1)
    # No device_ids: they name the one device a module lives on, for DDP to move the inputs to.
    # This module spans two and moves its own tensors, so DDP requires device_ids=None.
    model = DDP(model)
    return model


def plan_devices(gpu_count, requested_world_size=None, flag="--world-size"):
    """How many ranks run and where each rank's two stages live, from the GPU count alone, so
    the plan for 8 GPUs can be checked on a laptop: (world_size, [(dev0, dev1) per rank], note).
    More ranks than GPU pairs raise ValueError; its fix names flag (--world-size or torchrun's)."""
    if gpu_count == 0:
        world_size = requested_world_size or 2
        return world_size, [("cpu", "cpu")] * world_size, ""
    # A rank needs a pair of GPUs; a single GPU holds both stages of the one rank.
    pairs = max(1, gpu_count // 2)
    world_size = requested_world_size or pairs
    if world_size > pairs:
        raise ValueError(f"{flag} {world_size} needs {2 * world_size} GPUs (2 per rank), but "
                         f"{gpu_count} visible; use {flag} {pairs} or --backend gloo")
    if gpu_count == 1:
        return 1, [("cuda:0", "cuda:0")], ("note: one GPU, so both stages of the model share "
                                           "cuda:0 and the split moves nothing")
    devices = [(f"cuda:{2 * rank}", f"cuda:{2 * rank + 1}") for rank in range(world_size)]
    idle = f"note: each rank needs 2 GPUs, so cuda:{gpu_count - 1} stays idle"
    return world_size, devices, idle if gpu_count % 2 else ""


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    # The GPUs are planned per machine, so a rank's pair is found by its local rank (torchrun's
    # LOCAL_RANK; under mp.spawn, on one machine, the rank itself, whatever the environment says).
    local_rank = int(os.environ["LOCAL_RANK"]) if dist.is_torchelastic_launched() else rank
    dev0, dev1 = args.devices[local_rank]
    device = setup_process_group(rank, args.world_size, args.backend, dev0, args.timeout)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, rank, args.world_size)

    model = build_model(args, dev0, dev1)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir)
    if trainer.is_main_process:
        print(f"training on {args.world_size} x (fc1 on {dev0}, fc2 on {dev1}) ({args.backend}): "
              f"{len(train_set)} train / {len(test_set)} test wines, batch {args.batch_size} "
              f"per rank ({args.batch_size * args.world_size} in all)", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    correct, total = trainer.evaluate()
    if not trainer.is_main_process:
        return  # every rank holds the same results; rank 0 alone writes them
    save_atomically(cpu_state_dict(model.module), os.path.join(args.out_dir, "final.pt"))
    results = {"train_loss": losses, "test_correct": correct, "test_total": total,
               "test_accuracy": correct / total, "train_seconds": train_seconds,
               "wall_seconds": time.time() - start}
    save_atomically(describe_run(args, device) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


# =============================================================================================
# Plumbing: how the lesson starts, saves and reads its flags. Every lesson ends with it, and only
# the lesson that teaches a piece of it changes that piece: read it once, skip it after.
# =============================================================================================
def choose_backend(requested, world_size, flag="--world-size"):
    """NCCL when the ranks have GPUs, else gloo on the CPU; and where each rank's stages live."""
    gpus = torch.cuda.device_count() if requested != "gloo" and dist.is_nccl_available() else 0
    # --backend nccl without a GPU, more ranks than GPU pairs: one line (guard_rails.py).
    world_size, devices = guard_rails.check_device_plan(plan_devices, requested, gpus,
                                                        world_size, flag)
    return ("nccl" if gpus else "gloo"), world_size, devices


def setup_process_group(rank, world_size, backend, dev0, timeout):
    """Join the group of world_size processes; return this rank's device."""
    device = torch.device(dev0)  # its first: the batches and the running totals live there
    if backend == "nccl":
        # Pin each rank to its own GPU before anything touches CUDA, or all of them use GPU 0.
        torch.cuda.set_device(device)
    else:
        # The ranks share the cores: each gets its share of threads, or they fight over them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # Under torchrun, on several machines, only LOCAL_WORLD_SIZE of them share this one.
        torchrun = dist.is_torchelastic_launched()
        ranks_here = int(os.environ["LOCAL_WORLD_SIZE"]) if torchrun else world_size
        torch.set_num_threads(max(1, cores // ranks_here))
    # Meet rank 0 at MASTER_ADDR:MASTER_PORT; timeout bounds this wait and every collective after.
    # No device_id, unlike lesson 02: dev0 would bind NCCL to dev0 alone, and NCCL would refuse
    # the all-reduce of fc2's gradients, which DDP runs on dev1, where they live.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=None)
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
        # LOCAL_WORLD_SIZE (the ranks on this machine), MASTER_ADDR and MASTER_PORT. The GPUs
        # are planned, and the devices chosen, for the ranks on this machine.
        args.backend, _, args.devices = choose_backend(
            args.backend, int(os.environ["LOCAL_WORLD_SIZE"]), "torchrun's --nproc-per-node")
        args.world_size = int(os.environ["WORLD_SIZE"])
        return worker(int(os.environ["LOCAL_RANK"]), main, args)
    args.backend, args.world_size, args.devices = choose_backend(args.backend, args.world_size)
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


def describe_run(args, device):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": LESSON,
        "world_size": args.world_size,
        "backend": args.backend,
        "device": device.type,
        "stage_devices": args.devices[0],  # rank 0's
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
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write checkpoint.pt every N epochs")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for checkpoint.pt, final.pt and metrics.json")
    parser.add_argument("--world-size", type=int,
                        help="number of processes (unset: GPUs / 2, at least 1; 2 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when there are GPUs, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
