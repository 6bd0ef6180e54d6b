"""Lesson 03: DDP across several machines ("nodes"), with global and local ranks.

Lesson 02's program, now aware of nodes. Each node runs nproc_per_node processes; a process has a
local rank (0 .. nproc_per_node - 1, which picks its GPU on that node) and a global rank,
node_rank * nproc_per_node + local_rank (which picks its slice of the data and decides who logs
and writes). world_size = nnodes * nproc_per_node. Every process connects to global rank 0 at
--master-addr:--master-port, so that address must be reachable from every node.

Run it, by hand, one command per node (the script spawns that node's processes):
    python 03_multi_node/train.py                              # one node, as in lesson 02
    python 03_multi_node/train.py --nnodes 2 --node-rank 0     # two "nodes" on this machine:
    python 03_multi_node/train.py --nnodes 2 --node-rank 1     # run each in its own terminal
    # (with GPUs, add --backend gloo to both: the two would share GPUs, which NCCL refuses)
    # two machines, node 0 at 10.0.0.1: on node 0 (and the same with --node-rank 1 on node 1)
    python 03_multi_node/train.py --nnodes 2 --node-rank 0 --master-addr 10.0.0.1
With torchrun, which starts the processes itself (the script then does not spawn):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 \
        --master-port 29500 03_multi_node/train.py             # and --node-rank 1 on node 1
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job42 03_multi_node/train.py  # on every node
With Slurm, one torchrun per node:
    sbatch 03_multi_node/slurm/train.sbatch
"""

import argparse
import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from guard_rails import (
    MANUAL_LAUNCH_FLAGS,
    check_args,
    check_gloo_address,
    check_node_flags,
    fail,
    is_local_address,
    port_in_use,
    rank_guard,
    spawn_guard,
    start,
    started_by_torchrun,
    wait_for_master,
)


# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------
def global_rank(node_rank, nproc_per_node, local_rank):
    """Node 0 holds global ranks 0 .. nproc_per_node - 1, node 1 the next nproc_per_node, and
    so on. Every node must run the same number of processes for this to give each rank once."""
    return node_rank * nproc_per_node + local_rank


def choose_backend(requested, nproc_per_node):
    """NCCL when every process on this node can have its own GPU, else gloo on the CPU."""
    gpus = torch.cuda.device_count()  # this node's GPUs: the local rank picks one of them
    if requested == "nccl":
        if gpus == 0 or not dist.is_nccl_available():
            fail("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
        if nproc_per_node > gpus:
            fail(f"--nproc-per-node {nproc_per_node} with NCCL needs {nproc_per_node} GPUs on "
                 f"each node (one per process), but {gpus} visible; use --nproc-per-node "
                 f"{gpus} or --backend gloo")
        return "nccl"
    if requested == "auto" and 0 < nproc_per_node <= gpus and dist.is_nccl_available():
        return "nccl"
    if requested == "auto" and gpus > 0:
        print(f"note: {nproc_per_node} processes per node but {gpus} GPU(s); NCCL needs one GPU "
              "per process, so the ranks train on the CPU with gloo")
    return "gloo"


def find_free_port():
    # Port 0 asks the operating system for any free port. Two jobs started at the same moment
    # get different ports, where a fixed default such as 29500 would make the second one fail.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def setup_process_group(rank, local_rank, world_size, nproc_per_node, backend, timeout):
    """Join the group of world_size processes on all nodes; return this rank's device."""
    if backend == "nccl":
        # The local rank picks the GPU: every node numbers its GPUs from 0, so global rank 5 on
        # a node of 4 GPUs uses cuda:1. Pin it before anything touches CUDA, or every rank
        # would open a context on GPU 0 and NCCL would fail with "Duplicate GPU detected".
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # The ranks on this node share its cores: give each its share of threads, or they all
        # start one thread per core and spend their time fighting over them.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // nproc_per_node))
        device = torch.device("cpu")
    # MASTER_ADDR and MASTER_PORT (set by launch or torchrun) tell every rank where rank 0
    # listens. The timeout bounds the wait for the other ranks here, and every collective after
    # it: a rank that never arrives ends the job with an error instead of a silent hang (the
    # default is 10 minutes for NCCL, 30 for gloo).
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def rank_table(rank, local_rank, node_rank, settings):
    """Every rank's (global, local, node, host), gathered from all of them, in rank order.

    Each node was started by its own command, so the training settings are compared too: a
    node started with other flags would run other steps and hang or crash its peers."""
    mine = {"rank": rank, "local_rank": local_rank, "node_rank": node_rank,
            "host": socket.gethostname()}
    gathered = [None] * dist.get_world_size()
    # With NCCL the pickled objects travel on torch.cuda.current_device(), which is why each
    # rank must have called set_device first (all_gather_object's documentation).
    dist.all_gather_object(gathered, (mine, settings))
    for other, other_settings in gathered:
        for flag, value in other_settings.items():
            if value != gathered[0][1][flag]:
                fail(f"node {other['node_rank']} was started with --{flag} {value} but node 0 "
                     f"with --{flag} {gathered[0][1][flag]}; give every node the same flags")
    return [entry for entry, _ in gathered]


def save_atomically(obj, path):
    # Write to a temporary file in the same folder, then rename it over the target: a crash in
    # the middle of torch.save leaves the previous file intact instead of a half-written one.
    tmp_path = f"{path}.tmp"
    torch.save(obj, tmp_path)
    os.replace(tmp_path, path)


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
    # Imported here rather than at the top: only the ranks load data, so the launching process
    # skips scikit-learn's import (about a second on a laptop) before it starts them.
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
    # DistributedSampler deals each rank a disjoint slice of a seeded permutation, the same
    # permutation on every rank. If the data does not split evenly it repeats a few samples so
    # that every rank runs the same number of steps (a rank with one step fewer would leave the
    # others waiting forever in the gradient all-reduce). It shuffles, so the DataLoader doesn't.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class WineMLP(nn.Module):
    """13 measurements -> 64 hidden units -> 3 cultivars. The names fc1 and fc2 are the
    checkpoint keys of every lesson, so any lesson's final.pt loads into this class."""

    def __init__(self, in_features=13, hidden=64, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir,
                 rank, world_size):
        self.model = model
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank = rank
        self.world_size = world_size
        # One flag gates printing and file writes, so N ranks don't print N copies.
        self.is_main_process = rank == 0

    def train_step(self, features, labels):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(features), labels)
        # DDP's backward also all-reduces the gradients and divides them by world_size: the
        # average of the ranks' batch-mean gradients is the gradient of the global batch, so
        # every rank takes the step one process with world_size times the batch would take.
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def train_epoch(self, epoch):
        self.model.train()
        # Reseed the sampler's shuffle, or every epoch deals the same samples in the same order.
        self.train_loader.sampler.set_epoch(epoch)
        totals = torch.zeros(2, device=self.device)  # [sum of per-sample losses, samples]
        for features, labels in self.train_loader:
            features, labels = features.to(self.device), labels.to(self.device)
            # The loss is a mean over the batch; weight it by the batch size so the epoch's
            # mean is over samples, even when the last batch is smaller.
            totals[0] += self.train_step(features, labels) * len(labels)
            totals[1] += len(labels)
        # Each rank only saw its own slice. Sum the slices' totals over all ranks, so the loss
        # that rank 0 reports is the mean over every sample, not over rank 0's share.
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate(self):
        """Count correct predictions over the whole test set, each wine exactly once."""
        self.model.eval()
        # DistributedSampler would pad the 36 test wines to a multiple of world_size with
        # repeats, and the repeats would be counted twice. A plain stride gives every wine to
        # exactly one rank, some ranks get one fewer, and evaluation needs no lockstep.
        features = self.test_set.features[self.rank::self.world_size].to(self.device)
        labels = self.test_set.labels[self.rank::self.world_size].to(self.device)
        # The wrapped model (.module): evaluation needs none of DDP's synchronisation.
        predictions = self.model.module(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return int(counts[0]), int(counts[1])

    def save_checkpoint(self, epoch):
        # .module is the plain model inside DDP: its keys have no "module." prefix, so the file
        # loads into lesson 01's model. Every rank holds the same weights; one copy is enough.
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


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, local_rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, local_rank, args.world_size, args.nproc_per_node,
                                 args.backend, args.timeout)
    settings = {"epochs": args.epochs, "batch-size": args.batch_size, "lr": args.lr,
                "seed": args.seed, "save-every": args.save_every, "backend": args.backend}
    ranks = rank_table(rank, local_rank, args.node_rank, settings)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, rank,
                                      args.world_size)

    # From here on only the global rank matters: it picked this rank's slice of the data above,
    # and rank 0, on node 0, is the one process that prints and writes for the whole job.
    # Seed before building the model so the initial weights are the same on every rank.
    # (DDP also copies rank 0's weights to the others when it wraps the model.)
    torch.manual_seed(args.seed)
    model = WineMLP().to(device)
    # device_ids names the one GPU this rank's model lives on; on the CPU it is left out.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, rank, args.world_size)

    if trainer.is_main_process:
        print(f"rank = node_rank * {args.nproc_per_node} + local_rank:", flush=True)
        for entry in ranks:
            print(f"  rank {entry['rank']} = {entry['node_rank']} * {args.nproc_per_node} + "
                  f"{entry['local_rank']}  (host {entry['host']})", flush=True)
        print(f"training on {args.world_size} x {device.type} ({args.backend}): "
              f"{len(train_set)} train / {len(test_set)} test wines, batch {args.batch_size} "
              f"per rank ({args.batch_size * args.world_size} in all)", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    correct, total = trainer.evaluate()
    if not trainer.is_main_process:
        return  # every rank holds the same results; rank 0 alone writes them

    torch.save(model.module.state_dict(), os.path.join(args.out_dir, "final.pt"))
    metrics = {
        "lesson": "03_multi_node",
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
        "train_loss": losses,
        "test_correct": correct,
        "test_total": total,
        "test_accuracy": correct / total,
        "train_seconds": train_seconds,
        "wall_seconds": time.time() - start,
    }
    with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


def worker(local_rank, args):
    """What each process runs, started by mp.spawn or torchrun: main, then leave the group."""
    rank = global_rank(args.node_rank, args.nproc_per_node, local_rank)
    advice = {"meet_fix": "start every node with the same --nnodes, --nproc-per-node, "
                          "--master-addr and --master-port, or raise --timeout"}
    if args.nnodes > 1:
        others = " or ".join(str(node) for node in range(args.nnodes) if node != args.node_rank)
        advice["lost_fix"] = (f"a peer node went away, or stalled longer than --timeout: the log "
                              f"of node {others} says why")
    with rank_guard(rank, args, **advice):  # a failure becomes one line: guard_rails.py
        main(rank, local_rank, args)
        dist.destroy_process_group()


def run_under_torchrun(args):
    """torchrun has started this process and told it who it is; be that rank, do not spawn."""
    if any(getattr(args, name) is not None for name in MANUAL_LAUNCH_FLAGS):
        fail("under torchrun, give --nnodes, --node-rank, --nproc-per-node, --master-addr and "
             "--master-port to torchrun, not to the script")
    # torchrun's names: LOCAL_WORLD_SIZE is nproc_per_node, GROUP_RANK is the node rank.
    args.nproc_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.nnodes = args.world_size // args.nproc_per_node
    args.node_rank = int(os.environ["GROUP_RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # torchrun numbers the ranks with the same arithmetic; a mismatch means the nodes were
    # started with different --nproc-per-node.
    if global_rank(args.node_rank, args.nproc_per_node, local_rank) != int(os.environ["RANK"]):
        fail(f"torchrun gave this process RANK={os.environ['RANK']}, not node_rank * "
             "nproc_per_node + local_rank; start every node with the same --nproc-per-node")
    args.backend = choose_backend(args.backend, args.nproc_per_node)
    if args.backend == "gloo":
        check_gloo_address(os.environ["MASTER_ADDR"], args.nnodes)
    args.launcher = "torchrun"
    os.makedirs(args.out_dir, exist_ok=True)
    worker(local_rank, args)  # runs main, then ends this process


def launch(args):
    """Check the request, find rank 0, then start this node's processes (or, under torchrun,
    be the one process that torchrun started)."""
    args.start_time = time.time()
    if started_by_torchrun():
        run_under_torchrun(args)
        return
    args.launcher = "spawn"
    args.nnodes = args.nnodes or 1
    args.node_rank = args.node_rank or 0
    args.nproc_per_node = args.nproc_per_node or torch.cuda.device_count() or 2
    if args.node_rank >= args.nnodes:
        fail(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes}: node "
             f"ranks are 0 .. {args.nnodes - 1}, one per node")
    args.world_size = args.nnodes * args.nproc_per_node
    args.backend = choose_backend(args.backend, args.nproc_per_node)

    # Every rank, on every node, connects to global rank 0 at MASTER_ADDR:MASTER_PORT. A flag
    # wins over the environment. One node: the loopback address and any free port, as in
    # lesson 02. Several nodes: they must all be told the same port, so it has a fixed default.
    address = args.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = args.master_port or int(os.environ.get("MASTER_PORT", 0))
    if not port:
        port = find_free_port() if args.nnodes == 1 else 29500
    first = global_rank(args.node_rank, args.nproc_per_node, 0)
    last = global_rank(args.node_rank, args.nproc_per_node, args.nproc_per_node - 1)
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    print(f"node {args.node_rank} of {args.nnodes}: starting {ranks} of {args.world_size} "
          f"({args.backend}); rank 0 at {address}:{port}", flush=True)
    if args.node_rank == 0:
        # Rank 0 is about to listen here: the address must be this machine's, the port free.
        if not is_local_address(address):
            fail(f"--master-addr {address} is not an address of this machine, but node 0 runs "
                 "rank 0 and listens on it; give node 0 its own address (hostname -I)")
        if port_in_use(port):
            fail(f"port {port} is already in use on this machine; choose another with "
                 "--master-port, the same on every node")
    if args.backend == "gloo":
        check_gloo_address(address, args.nnodes)
    if args.node_rank > 0 and not wait_for_master(address, port, args.timeout):
        # Checked here, before spawning, so that an unreachable master is one clear line.
        fail(f"nothing answered at {address}:{port} within {args.timeout:g} s; start node 0 "
             "first, give every node node 0's address and port (--master-addr, --master-port) "
             "and check that a firewall lets that port through, or raise --timeout")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    os.makedirs(args.out_dir, exist_ok=True)
    # spawn starts nproc_per_node fresh Python processes on this node and calls
    # worker(local_rank, args) in each, local_rank = 0 .. nproc_per_node - 1. If one fails,
    # spawn stops the others on this node; the other nodes' ranks then fail too, within
    # --timeout at most, as their next collective loses its peer.
    with spawn_guard("local rank"):
        mp.spawn(worker, args=(args,), nprocs=args.nproc_per_node)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 03: train the wine MLP with DDP across nodes (by hand, torchrun or "
                    "Slurm).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    parser.add_argument("--save-every", type=int, default=10,
                        help="write checkpoint.pt every N epochs")
    parser.add_argument("--out-dir", default="runs/03_multi_node",
                        help="folder for checkpoint.pt, final.pt and metrics.json (on node 0)")
    parser.add_argument("--nnodes", type=int, help="number of nodes (default: 1)")
    parser.add_argument("--node-rank", type=int,
                        help="this node's number, 0 .. nnodes - 1; node 0 runs rank 0 "
                             "(default: 0)")
    parser.add_argument("--nproc-per-node", type=int,
                        help="processes on each node (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--master-addr",
                        help="node 0's address, as every node reaches it (default: "
                             "$MASTER_ADDR, else 127.0.0.1)")
    parser.add_argument("--master-port", type=int,
                        help="the port rank 0 listens on, the same on every node (default: "
                             "$MASTER_PORT, else any free port with one node, 29500 with more)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every process has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others (to start, or in any "
                             "collective) before giving up with an error")
    return check_node_flags(check_args(parser.parse_args(argv)))


if __name__ == "__main__":
    start(launch, parse_args, torchrun_ok=True)
