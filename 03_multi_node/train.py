"""Lesson 03: DDP across several machines ("nodes"), with global and local ranks.

Lesson 02's program, now on nnodes nodes of nproc_per_node processes each. A process's local rank
(0 .. nproc_per_node - 1) picks its GPU on its node; its global rank, node_rank * nproc_per_node +
local_rank, picks its slice of the data and decides who writes. Every process, on every node,
meets global rank 0 at --master-addr:--master-port.

Run it:
    python 03_multi_node/train.py                           # one node, as in lesson 02
    python 03_multi_node/train.py --nnodes 2 --node-rank 0  # two "nodes" on one machine: run
    python 03_multi_node/train.py --nnodes 2 --node-rank 1  # each in its own terminal
    python 03_multi_node/train.py --nnodes 2 --node-rank 0 --master-addr 10.0.0.1
        # two machines: this on 10.0.0.1, and the same with --node-rank 1 on the other
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 \
        --master-port 29500 03_multi_node/train.py          # torchrun starts the processes
    sbatch 03_multi_node/slurm/train.sbatch                 # Slurm: one torchrun per node
With GPUs, two "nodes" on one machine need --backend gloo: NCCL refuses two ranks on one GPU.
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
        loss = F.cross_entropy(self.model(features), labels)
        # In backward, DDP all-reduces the gradients and divides by world_size: the mean of the
        # ranks' batch means is the global batch's mean gradient, the same step on every rank.
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
    return model


def print_rank_table(ranks, args):
    """Rank 0 shows every rank's global rank worked out from its node and local rank."""
    print(f"rank = node_rank * {args.nproc_per_node} + local_rank:", flush=True)
    for entry in ranks:
        print(f"  rank {entry['rank']} = {entry['node_rank']} * {args.nproc_per_node} + "
              f"{entry['local_rank']}  (host {entry['host']})", flush=True)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, local_rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, local_rank, args.world_size, args.nproc_per_node,
                                 args.backend, args.timeout)
    ranks = guard_rails.rank_table(rank, local_rank, args)  # every rank's numbers, gathered
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, rank, args.world_size)

    # From here on only the global rank matters: it picked this rank's data, and rank 0 writes.
    model = build_model(args, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir)
    if trainer.is_main_process:
        print_rank_table(ranks, args)
        print(f"training on {args.world_size} x {device.type} ({args.backend}): "
              f"{len(train_set)} train / {len(test_set)} test wines, batch {args.batch_size} "
              f"per rank ({args.batch_size * args.world_size} in all)", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    correct, total = trainer.evaluate()
    if not trainer.is_main_process:
        if local_rank == 0:  # one line on every other node, so that its log says how it ended
            print(f"node {args.node_rank} done: test accuracy {correct}/{total} (rank 0 writes "
                  "the results)", flush=True)
        return  # every rank holds the same results; rank 0 alone writes them
    save_atomically(cpu_state_dict(model.module), os.path.join(args.out_dir, "final.pt"))
    results = {"train_loss": losses, "test_correct": correct, "test_total": total,
               "test_accuracy": correct / total, "train_seconds": train_seconds,
               "wall_seconds": time.time() - start}
    save_atomically(describe_run(args, device, ranks) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


# =============================================================================================
# Plumbing: how the lesson starts, saves and reads its flags. Every lesson ends with it, and only
# the lesson that teaches a piece of it changes that piece: read it once, skip it after.
# =============================================================================================
def choose_backend(requested, nproc_per_node):
    """NCCL when every rank can have its own GPU, else gloo on the CPU."""
    guard_rails.check_backend(requested, nproc_per_node, "--nproc-per-node")  # this node's GPUs
    if requested == "nccl" or (requested == "auto" and dist.is_nccl_available()
                               and 0 < nproc_per_node <= torch.cuda.device_count()):
        return "nccl"
    return "gloo"


def setup_process_group(rank, local_rank, world_size, nproc_per_node, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    if backend == "nccl":
        # Pin each rank to its own GPU before anything touches CUDA, or all of them use GPU 0.
        torch.cuda.set_device(local_rank)  # each node numbers its GPUs from 0
        device = torch.device("cuda", local_rank)
    else:
        # The ranks share the cores: each gets its share of threads, or they fight over them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // nproc_per_node))  # the cores of this node
        device = torch.device("cpu")
    # Meet rank 0 at MASTER_ADDR:MASTER_PORT; timeout bounds this wait and every collective after.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def global_rank(node_rank, nproc_per_node, local_rank):
    """Node 0 holds global ranks 0 .. nproc_per_node - 1, node 1 the next nproc_per_node, and
    so on. Every node must run the same number of processes for this to give each rank once."""
    return node_rank * nproc_per_node + local_rank


def worker(local_rank, main, args):
    """What each process runs, started by mp.spawn or torchrun: main, then leave the group."""
    rank = global_rank(args.node_rank, args.nproc_per_node, local_rank)
    with guard_rails.node_guard(rank, args):  # a failure becomes one line: guard_rails.py
        main(rank, local_rank, args)
        dist.destroy_process_group()


def run_under_torchrun(main, args):
    """torchrun started this process and told it, in its environment, who it is: be that one."""
    # torchrun's names: LOCAL_WORLD_SIZE is nproc_per_node, GROUP_RANK the node rank.
    args.nproc_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.nnodes = args.world_size // args.nproc_per_node
    args.node_rank = int(os.environ["GROUP_RANK"])
    args.backend = choose_backend(args.backend, args.nproc_per_node)
    args.launcher = "torchrun"
    guard_rails.check_nodes(args)  # node flags belong to torchrun; its RANK must be the formula's
    worker(int(os.environ["LOCAL_RANK"]), main, args)


def launch(main, args):
    """Find rank 0, then start this node's processes; under torchrun, be the one it started."""
    args.start_time = time.time()
    if guard_rails.started_by_torchrun():
        return run_under_torchrun(main, args)
    args.launcher = "spawn"
    args.world_size = args.nnodes * args.nproc_per_node
    args.backend = choose_backend(args.backend, args.nproc_per_node)
    # One node takes any free port, as in lesson 02; several must all be told the same: 29500.
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port or (
        guard_rails.find_free_port() if args.nnodes == 1 else 29500))
    guard_rails.check_nodes(args)  # rank 0's address and port, before spawning
    print(f"node {args.node_rank} of {args.nnodes}: starting {args.nproc_per_node} of "
          f"{args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # mp.spawn(worker, args=(main, args), nprocs=args.nproc_per_node): local ranks 0 .. N - 1,
    # each forked from a server that has imported torch and these once (lesson 02's README).
    # If one fails, spawn stops the others here; the other nodes' ranks lose it, and stop.
    preload = ["torch._dynamo", "sklearn.datasets", "sklearn.model_selection",
               "sklearn.preprocessing"]
    with guard_rails.spawn_guard("local rank"):
        guard_rails.start_ranks(worker, (main, args), args.nproc_per_node, preload,
                                check_port=False)  # check_nodes has checked it


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


def describe_run(args, device, ranks):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": LESSON,
        "world_size": args.world_size,
        "nnodes": args.nnodes,
        "nproc_per_node": args.nproc_per_node,
        "launcher": args.launcher,
        "ranks": ranks,
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
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write checkpoint.pt every N epochs")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for checkpoint.pt, final.pt and metrics.json")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node's number, 0 .. nnodes - 1; node 0 runs rank 0")
    parser.add_argument("--nproc-per-node", type=int, default=torch.cuda.device_count() or 2,
                        help="processes on each node (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                        help="node 0's address, reachable from every node ($MASTER_ADDR if set)")
    parser.add_argument("--master-port", type=int, default=os.environ.get("MASTER_PORT"),
                        help="rank 0's port, the same on every node (default: $MASTER_PORT, now "
                             "%(default)s; unset: 29500 with several nodes, any free one with one)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
