"""Run a lesson with one piece swapped, for the tests that need a fault or a control.

    python tests/patched_lesson.py <lesson>/train.py PATCH [lesson arguments...]

PATCH is one of:
  no-ddp          replace DistributedDataParallel by a wrapper that does not synchronise
                  gradients: each rank trains on its own (the control for the DDP-math test)
  raise-on-rank-1 rank 1 raises at the start of its second epoch (a crashed rank); not in a
                  torchrun restart (TORCHELASTIC_RESTART_COUNT above 0), which gets past it
  die-while-saving
                  the second torch.save of the run writes half its bytes, then its process is
                  killed (SIGKILL), as by a power cut or the out-of-memory killer mid-write
  log-writes      every save_atomically call prints "write <file name> by rank <rank>"
  log-loads       every torch.load in the lesson's own code prints "load by rank <rank> onto
                  <map_location>" (the guard rails' own checks of the file are not counted)
  count-all-reduces
                  a DDP communication hook counts the gradient all-reduces; at the end each rank
                  prints "rank <rank>: <n> gradient all-reduces in <steps> optimizer steps"
  count-all-reduces-without-no-sync
                  the same count, with DDP's no_sync doing nothing, so that every backward
                  all-reduces (lesson 06's control)
  loss-not-divided
                  each micro-batch's loss is not divided by --accumulate (lesson 06's control)
  kill-rank-1     rank 1 kills itself with SIGKILL (kill -9) at the start of its second epoch;
                  not in a torchrun restart, which gets past it
  stall-rank-1    rank 1 sleeps for 5 minutes at the start of its second epoch (a rank that
                  hangs), so its peers wait in their next collective until --timeout
  abort-rank-1    rank 1 ends with SIGABRT at the start of its second epoch, as NCCL's watchdog
                  ends a rank whose collective waited longer than --timeout
  no-gradient-sync
                  gradients are never combined across ranks: DDP keeps each rank's own (a
                  communication hook that skips the all-reduce), and FSDP's reduce-scatter hands
                  each rank the slice of its own gradient instead of the sum over ranks (the
                  control for lesson 07's sharding-math test)

spawn starts each rank by re-running this file's top level (as __mp_main__), so the patch is
applied in every rank, not only in the launching process.
"""

import contextlib
import importlib.util
import inspect
import io
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

script, patch = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # where train.py finds guard_rails
spec = importlib.util.spec_from_file_location("lesson", script)
lesson = importlib.util.module_from_spec(spec)
sys.modules["lesson"] = lesson  # so the ranks can unpickle lesson.main
spec.loader.exec_module(lesson)


class NoSync(nn.Module):
    def __init__(self, module, **_ignored):
        super().__init__()
        self.module = module

    def forward(self, *inputs):
        return self.module(*inputs)


def raise_on_rank_1(self, epoch):
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if self.rank == 1 and epoch == 1 and not restarted:
        raise RuntimeError("injected failure on rank 1")
    return original_train_epoch(self, epoch)


def kill_rank_1(self, epoch):
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if self.rank == 1 and epoch == 1 and not restarted:
        os.kill(os.getpid(), signal.SIGKILL)
    return original_train_epoch(self, epoch)


def stall_rank_1(self, epoch):
    if self.rank == 1 and epoch == 1:
        time.sleep(300)
    return original_train_epoch(self, epoch)


def abort_rank_1(self, epoch):
    if self.rank == 1 and epoch == 1:
        os.abort()
    return original_train_epoch(self, epoch)


saves = 0


def die_while_saving(obj, f, *args, **kwargs):
    global saves
    saves += 1
    if saves < 2:
        return original_save(obj, f, *args, **kwargs)
    buffer = io.BytesIO()
    original_save(obj, buffer, *args, **kwargs)
    f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def log_writes(obj, path):
    print(f"write {os.path.basename(path)} by rank {dist.get_rank()}", flush=True)
    return original_save_atomically(obj, path)


class TorchLoadsLogged:
    """torch, as the lesson's own code sees it, with load saying which rank loads onto what."""

    def __getattr__(self, name):
        return getattr(torch, name)

    def load(self, f, *args, map_location=None, **kwargs):
        # One write per line: the ranks load at the same time.
        sys.stdout.write(f"load by rank {dist.get_rank()} onto {map_location}\n")
        sys.stdout.flush()
        return torch.load(f, *args, map_location=map_location, **kwargs)


all_reduces = 0


def counting_hook(state, bucket):
    """The all-reduce DDP does by default (average over the ranks), counted."""
    global all_reduces
    all_reduces += 1
    return default_hooks.allreduce_hook(None, bucket)


def counting_ddp(module, **kwargs):
    model = original_ddp(module, **kwargs)
    model.register_comm_hook(None, counting_hook)
    return model


def train_and_report(self, max_epochs):
    losses = original_train(self, max_epochs)
    # One write per line: rank 0 prints at the same time, and print writes the newline apart.
    sys.stdout.write(f"rank {self.rank}: {all_reduces} gradient all-reduces in {self.steps} "
                     "optimizer steps\n")
    sys.stdout.flush()
    return losses


def accumulate_from_argv():
    arguments = sys.argv[3:]
    return int(arguments[arguments.index("--accumulate") + 1]) if "--accumulate" in arguments else 1


class LossTimes:
    """torch.nn.functional, with cross_entropy's result multiplied by a factor."""

    def __init__(self, factor):
        self.factor = factor

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def cross_entropy(self, *args, **kwargs):
        return torch.nn.functional.cross_entropy(*args, **kwargs) * self.factor


def keep_local_gradients(_state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class DDPWithoutAllReduce(DistributedDataParallel):
    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        self.register_comm_hook(None, keep_local_gradients)


def reduce_scatter_without_sum(output, input, group=None, op=None, async_op=False):
    output.copy_(input.chunk(dist.get_world_size(group))[dist.get_rank(group)])


original_train_epoch = lesson.Trainer.train_epoch
original_train = lesson.Trainer.train
original_ddp = getattr(lesson, "DDP", None)  # lesson 09 has no DDP
original_save = torch.save
original_save_atomically = getattr(lesson, "save_atomically", None)
if patch == "no-ddp":
    lesson.DDP = NoSync
elif patch == "raise-on-rank-1":
    lesson.Trainer.train_epoch = raise_on_rank_1
elif patch == "die-while-saving":
    torch.save = die_while_saving
elif patch == "kill-rank-1":
    lesson.Trainer.train_epoch = kill_rank_1
elif patch == "stall-rank-1":
    lesson.Trainer.train_epoch = stall_rank_1
elif patch == "abort-rank-1":
    lesson.Trainer.train_epoch = abort_rank_1
elif patch == "log-writes":
    lesson.save_atomically = log_writes
elif patch == "log-loads":
    lesson.torch = TorchLoadsLogged()
elif patch == "count-all-reduces":
    lesson.DDP = counting_ddp
    lesson.Trainer.train = train_and_report
elif patch == "count-all-reduces-without-no-sync":
    lesson.DDP = counting_ddp
    lesson.Trainer.train = train_and_report
    DistributedDataParallel.no_sync = lambda self: contextlib.nullcontext()
elif patch == "loss-not-divided":
    # The lesson weights each micro-batch's loss by its share of the step, 1/K for equal
    # micro-batches; multiplying by K undoes that.
    lesson.F = LossTimes(accumulate_from_argv())
elif patch == "no-gradient-sync":
    # Every module of the lesson's folder that builds a DDP: train.py, or 07's sharding.py.
    folder = os.path.dirname(os.path.abspath(script))
    for module in list(sys.modules.values()):
        where = getattr(module, "__file__", None) or ""
        if getattr(module, "DDP", None) is DistributedDataParallel and (
                os.path.dirname(os.path.abspath(where)) == folder):
            module.DDP = DDPWithoutAllReduce
    dist.reduce_scatter_single = reduce_scatter_without_sum
else:
    sys.exit(f"error: unknown patch {patch!r}")

if __name__ == "__main__":
    # sys.argv stays as it is: spawn hands it to the ranks, which need the patch's name.
    args = lesson.parse_args(sys.argv[3:])
    launch = getattr(lesson, "launch", None)
    if launch is None:
        lesson.main(args)
    elif len(inspect.signature(launch).parameters) == 2:  # launch(main, args): main on each rank
        launch(lesson.main, args)
    else:
        launch(args)
