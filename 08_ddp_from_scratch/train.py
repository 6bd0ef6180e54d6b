"""Lesson 08: DDP from scratch: the gradient averaging that DDP does, written by hand.

Lesson 02's program, with DistributedDataParallel replaced by the gradient synchronisation of
grad_sync.py (read it first), chosen by --grad-sync: after-backward, flat, overlap or buckets,
the default, as DDP's reducer does. --grad-sync ddp runs DDP itself; every mode ends on its weights.

Run it:
    python 08_ddp_from_scratch/train.py                  # buckets; a rank per GPU, or 2 CPU ranks
    python 08_ddp_from_scratch/train.py --grad-sync after-backward --out-dir runs/08_after
    python 08_ddp_from_scratch/train.py --hidden 1024 --layers 4 --lr 1e-3 --bucket-mb 1 \
        --profile-step 5 --out-dir runs/08_large     # a larger model; a trace of step 5
    torchrun --standalone --nproc-per-node 2 08_ddp_from_scratch/train.py   # torchrun starts it too
"""

import argparse
import contextlib
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
from grad_sync import GRAD_SYNC, make_grad_sync, plan_buckets
from model import WineMLP


# ---------------------------------------------------------------------------------------------
# The lesson: the training step, and how the data and the model come in
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, model, train_loader, test_set, optimizer, device, save_every, out_dir,
                 finish, profile_step):
        self.model = model
        self.plain_model = model.module if isinstance(model, DDP) else model  # without DDP
        self.train_loader = train_loader
        self.test_set = test_set
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.out_dir = out_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # from the group
        self.is_main_process = self.rank == 0  # gates printing and writing: one copy, not N
        self.finish, self.profile_step = finish, profile_step
        self.steps, self.all_reduces = 0, None  # steps taken; finish()'s all-reduces in the last

    def train_step(self, features, labels):
        self.steps += 1
        profiling = self.steps == self.profile_step
        # One step under the profiler: every operation and all-reduce, on one time axis.
        with torch.profiler.profile() if profiling else contextlib.nullcontext() as profiler:
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(features), labels)
            with torch.profiler.record_function("backward"):  # a named span in the trace
                loss.backward()
            # The all-reduces make the mean of the ranks' batch means: the global batch's mean
            # gradient, the same step on every rank. finish() waits for the ones the hooks
            # started in backward, or runs them all now; DDP has done them inside backward.
            with torch.profiler.record_function("finish"):
                self.all_reduces = self.finish()
            self.optimizer.step()
        if profiling:  # every rank writes its own: the notebook draws them side by side
            profiler.export_chrome_trace(os.path.join(self.out_dir, f"trace_rank{self.rank}.json"))
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
        predictions = self.plain_model(features).argmax(dim=1)
        counts = torch.tensor([(predictions == labels).sum(), len(labels)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return int(counts[0]), int(counts[1])

    def save_checkpoint(self, epoch):
        # The model inside DDP (.module): keys without a "module." prefix, as lesson 01 loads.
        checkpoint = {"model": self.plain_model.state_dict(), "epochs_completed": epoch + 1}
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
    """The wine MLP, on this rank's device, and finish(), which averages its gradients."""
    # Seed before building the model so the initial weights are the same on every run.
    torch.manual_seed(args.seed)
    model = WineMLP(hidden=args.hidden, layers=args.layers).to(device)
    # The lesson (grad_sync.py): rank 0's weights to every rank, and the gradients averaged.
    return make_grad_sync(model, args.grad_sync, args.bucket_mb)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(rank, args):
    start = args.start_time  # set by launch, before the ranks were started
    device = setup_process_group(rank, args.world_size, args.backend, args.timeout)
    train_set, test_set = load_data()
    train_loader = prepare_dataloader(train_set, args.batch_size, args.seed, rank, args.world_size)

    model, finish = build_model(args, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_loader, test_set, optimizer, device, args.save_every,
                      args.out_dir, finish, args.profile_step)
    if trainer.is_main_process:
        print(f"training on {args.world_size} x {device.type} ({args.backend}): "
              f"{len(train_set)} train / {len(test_set)} test wines, batch {args.batch_size} "
              f"per rank ({args.batch_size * args.world_size} in all) | --grad-sync "
              f"{args.grad_sync}", flush=True)
    train_start = time.perf_counter()
    losses = trainer.train(args.epochs)
    train_seconds = time.perf_counter() - train_start
    correct, total = trainer.evaluate()
    if not trainer.is_main_process:
        return  # every rank holds the same results; rank 0 alone writes them
    averaging = report_grad_sync(trainer, args, len(train_loader.sampler), train_seconds)
    save_atomically(cpu_state_dict(trainer.plain_model), os.path.join(args.out_dir, "final.pt"))
    results = {"train_loss": losses, "test_correct": correct, "test_total": total,
               "test_accuracy": correct / total, "train_seconds": train_seconds,
               "wall_seconds": time.time() - start}
    save_atomically(describe_run(args, device) | averaging | results,
                    os.path.join(args.out_dir, "metrics.json"))
    print(f"test accuracy: {correct}/{total} = {correct / total:.1%} "
          f"| results in {args.out_dir}", flush=True)


def report_grad_sync(trainer, args, samples_per_rank, train_seconds):
    """Rank 0's lines on the averaging: the all-reduces of a step, and the buckets they sent;
    what metrics.json records of it."""
    samples_per_second = args.epochs * samples_per_rank * args.world_size / train_seconds
    buckets = plan_buckets(trainer.plain_model, args.bucket_mb)
    print(f"{samples_per_second:.0f} samples/s over all ranks, {trainer.steps} optimizer steps",
          flush=True)
    if args.grad_sync == "ddp":
        print("gradient all-reduces: inside DDP's backward (--profile-step shows them)", flush=True)
    else:
        print(f"gradient all-reduces per step: {trainer.all_reduces}", flush=True)
    for i, bucket in enumerate(buckets if args.grad_sync == "buckets" else []):
        size = sum(param.numel() * param.element_size() for _, param in bucket)
        print(f"  bucket {i} ({size:,} bytes): {' '.join(name for name, _ in bucket)}",
              flush=True)
    if args.profile_step and args.profile_step > trainer.steps:
        print(f"note: --profile-step {args.profile_step} is past the last step "
              f"({trainer.steps}): no trace written", flush=True)
    return {"samples_per_second": samples_per_second,
            "all_reduces_per_step": trainer.all_reduces,  # None for ddp: DDP does not say
            "buckets": [[name for name, _ in bucket] for bucket in buckets],  # the plan
            "optimizer_steps": trainer.steps}


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


def describe_run(args, device):
    """What metrics.json records of the run beside its results: the lesson and its settings."""
    return {
        "lesson": LESSON,
        "grad_sync": args.grad_sync,
        "bucket_mb": args.bucket_mb,
        "hidden": args.hidden,
        "layers": args.layers,
        "world_size": args.world_size,
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
                        help="folder for checkpoint.pt, final.pt, metrics.json and traces")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() or 2,
                        help="number of processes (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a rank waits for the others before it stops with an error")
    parser.add_argument("--grad-sync", default="buckets", choices=GRAD_SYNC,
                        help="how the ranks average their gradients (grad_sync.py); ddp: DDP "
                             "itself; none: no averaging, the control that shows tests can fail")
    parser.add_argument("--bucket-mb", type=float, default=25,
                        help="bucket size in MiB for buckets and ddp (DDP's bucket_cap_mb)")
    parser.add_argument("--hidden", type=int, default=64, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=1,
                        help="hidden layers; more than 1 adds hidden x hidden layers")
    parser.add_argument("--profile-step", type=int,
                        help="write each rank's profile of this optimizer step (1 is the first) "
                             "as a Chrome trace, trace_rank<rank>.json in --out-dir")
    return guard_rails.check_args(parser.parse_args(argv))


if __name__ == "__main__":
    guard_rails.start(main, parse_args, launch, torchrun_ok=True)
