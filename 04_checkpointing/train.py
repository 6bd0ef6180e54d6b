"""Lesson 04: snapshots that survive a crash, and a resume that loses nothing.

Lesson 02's program, made fault tolerant. Every --save-every epochs, global rank 0 alone writes
<out-dir>/snapshot.pt atomically, and every rank waits at a barrier until it is on disk. A run
whose --out-dir holds a snapshot resumes from it: each rank loads it onto its own device and
starts at the next epoch. Under torchrun --max-restarts, a crashed job restarts and resumes.

Run it:
    python 04_checkpointing/train.py                             # 2 CPU ranks, or every GPU
    python 04_checkpointing/train.py --world-size 1 --epochs 25  # resumes it: 1 rank, 5 epochs more
    # One rank dies at the start of epoch 3; the same command again resumes at epoch 3:
    python 04_checkpointing/train.py --out-dir runs/04_crash --save-every 2 --crash-at-epoch 3
    python 04_checkpointing/train.py --out-dir runs/04_crash --save-every 2 --crash-at-epoch 3
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 04_checkpointing/train.py \
        --out-dir runs/04_torchrun --save-every 2 --crash-at-epoch 3   # restarts itself
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
        self.snapshot_path = os.path.join(out_dir, "snapshot.pt")
        self.epochs_completed, self.losses = 0, []
        self.crash_at_epoch = self.settings = None  # main sets both from its flags

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

    def save_snapshot(self):
        # The model inside DDP (.module): keys without a "module." prefix, as lesson 01 loads.
        # The optimizer's state too: without it Adam's running averages restart from zero, and
        # the resumed run would take other steps than the one that never stopped.
        snapshot = {"model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "epochs_completed": self.epochs_completed,  # also the next epoch's index
                    "train_loss": self.losses, "world_size": self.world_size,
                    "settings": self.settings}  # flags a resume must not change
        save_atomically(snapshot, self.snapshot_path)

    def load_snapshot(self, snapshot_file):
        # map_location: the tensors were saved from rank 0's device, cuda:0 on GPUs; without it
        # every rank would load its copy onto cuda:0. weights_only=True builds tensors and plain
        # containers only: a file that tries to build anything else (and run code) is refused.
        snapshot = torch.load(snapshot_file, map_location=self.device, weights_only=True)
        self.model.module.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.epochs_completed = snapshot["epochs_completed"]
        self.losses = list(snapshot["train_loss"])

    def train(self, max_epochs):
        losses = self.losses  # the snapshot's, if this run resumed
        # From the snapshot's next epoch, not from 0: no epoch repeated, none skipped.
        for epoch in range(self.epochs_completed, max_epochs):
            if epoch + 1 == self.crash_at_epoch and self.rank == self.world_size - 1:
                raise RuntimeError(f"simulated crash of rank {self.rank} at the start of epoch "
                                   f"{epoch + 1} (--crash-at-epoch)")
            start = time.perf_counter()
            loss = self.train_epoch(epoch)
            losses.append(loss)
            self.epochs_completed = epoch + 1
            if self.is_main_process:
                print(f"epoch {epoch + 1:3d}/{max_epochs} | train loss {loss:.4f} "
                      f"| {time.perf_counter() - start:.3f} s", flush=True)
            if self.epochs_completed % self.save_every == 0 or self.epochs_completed == max_epochs:
                # Rank 0 alone writes: the ranks hold the same weights, and N ranks writing one
                # file (N nodes, on a shared filesystem) would corrupt it. Every rank then waits
                # until it is on disk: once any rank is in the next epoch, this snapshot exists.
                with guard_rails.barrier_after_save(self.rank):  # if rank 0 cannot write, all stop
                    if self.is_main_process:
                        self.save_snapshot()
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


def resume(trainer, rank, args):
    """Load the snapshot in --out-dir, if there is one; return the epochs it holds."""
    # Rank 0 alone decides whether to resume and tells the others: ranks deciding on their own
    # (a node with no copy, or an old one) could start at different epochs and wait forever.
    snapshot_file = guard_rails.snapshot_to_resume(rank, trainer.snapshot_path, args, WineMLP)
    if snapshot_file is not None:
        trainer.load_snapshot(snapshot_file)
    done = trainer.epochs_completed  # 0 unless resumed
    if trainer.is_main_process and done == args.epochs:
        print(f"note: {trainer.snapshot_path} already holds all {done} epochs: nothing left "
              "to train; raise --epochs to go on, or another --out-dir starts afresh", flush=True)
    elif trainer.is_main_process and done > 0:
        print(f"resuming from {trainer.snapshot_path}: {done} of {args.epochs} epochs done, "
              f"continuing at epoch {done + 1}", flush=True)
    # --crash-at-epoch fails a new run once: not one that resumed, nor torchrun's restart of it.
    if done == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        trainer.crash_at_epoch = args.crash_at_epoch
    return done


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, args.world_size, args.backend, args.timeout)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, rank, args.world_size)

    model = build_model(args, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir)
    trainer.settings = guard_rails.run_settings(args)  # the flags a resume must not change
    done = resume(trainer, rank, args)  # the epochs a snapshot holds: 0 for a new run
    if trainer.is_main_process and done < args.epochs:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): "
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
    save_atomically(describe_run(args, device, done) | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


# =============================================================================================
# Plumbing: how the lesson starts, saves and reads its flags. Every lesson ends with it, and only
# the lesson that teaches a piece of it changes that piece: read it once, skip it after.
# =============================================================================================
def choose_backend(requested, world_size, flag="--world-size"):
    """NCCL when every rank can have its own GPU, else gloo on the CPU."""
    guard_rails.check_backend(requested, world_size, flag)  # nccl that cannot work: one line
    if requested == "nccl" or (requested == "auto" and dist.is_nccl_available()
                               and 0 < world_size <= torch.cuda.device_count()):
        return "nccl"
    return "gloo"


def setup_process_group(rank, world_size, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    # torchrun numbers the GPUs and shares the cores per node; mp.spawn's ranks are all on this
    # one. Read only under torchrun: some clusters export LOCAL_RANK to every process.
    local_rank, local_ranks = ((int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
                               if guard_rails.started_by_torchrun() else (rank, world_size))
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


def worker(rank, main, args):
    with guard_rails.rank_guard(rank, args):  # a failure becomes one line: guard_rails.py
        main(rank, args)
        dist.destroy_process_group()


def launch(main, args):
    """Pick the backend and rank 0's port, then run main in world_size new processes; under
    torchrun, which started the ranks, be the one it started."""
    args.start_time = time.time()
    if guard_rails.started_by_torchrun():
        # torchrun started this process as one rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
        # MASTER_PORT); after a crash it starts them all again, and they resume from the snapshot.
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.backend = choose_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "torchrun's --nproc-per-node")
        return worker(int(os.environ["RANK"]), main, args)
    args.backend = choose_backend(args.backend, args.world_size)
    # A snapshot that cannot be resumed: one line now, before any rank starts.
    guard_rails.check_snapshot(os.path.join(args.out_dir, "snapshot.pt"), args, WineMLP)
    # Rank 0 listens on this machine: a MASTER_PORT already set wins, else any free port.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(guard_rails.find_free_port()))
    print(f"starting {args.world_size} ranks ({args.backend}); rank 0 listens on "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    # mp.spawn(worker, args=(main, args), nprocs=args.world_size): ranks 0 .. world_size - 1,
    # each forked from a server that has imported torch and these once (lesson 02's README).
    preload = ["torch._dynamo", "sklearn.datasets", "sklearn.model_selection",
               "sklearn.preprocessing"]
    with guard_rails.spawn_guard("rank", ". Run the same command again to resume from the "
                                 "last snapshot"):
        guard_rails.start_ranks(worker, (main, args), args.world_size, preload)


def cpu_state_dict(model):
    # As CPU tensors the weights load on any machine as they are, with a GPU or without.
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


def save_atomically(obj, path):
    # Write to a temporary file in the same folder, then rename it over the target: a crash in
    # the middle of the write leaves the previous file intact instead of a half-written one.
    # fsync puts the bytes on disk before the rename, so a power cut cannot leave an empty file.
    from guard_rails import save_or_fail  # a failed write (a full disk): one line, not a traceback

    tmp_path = f"{path}.tmp"
    with save_or_fail(path, tmp_path):
        with open(tmp_path, "wb") as f:
            if path.endswith(".json"):  # metrics.json: text, for people and plotting tools
                f.write(json.dumps(obj, indent=2).encode())
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)


LESSON = os.path.basename(os.path.dirname(os.path.abspath(__file__)))  # this folder's name


def describe_run(args, device, done):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": LESSON,
        "world_size": args.world_size,
        "launcher": "torchrun" if guard_rails.started_by_torchrun() else "spawn",
        "resumed_after_epoch": done,
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
                        help="write snapshot.pt every N epochs, and after the last")
    parser.add_argument("--out-dir", default=f"runs/{LESSON}",
                        help="folder for snapshot.pt, final.pt and metrics.json; a snapshot "
                             "already there is resumed")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() or 2,
                        help="number of processes (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--crash-at-epoch", type=int, default=None,
                        help="one rank fails at the start of this epoch (in a new run only)")
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
