"""Run lesson 08 once for every --grad-sync mode, all of them on the same ranks, for its tests.

    python tests/every_grad_sync.py OUT_DIR NAME [lesson 08 flags...] [:: NAME [flags...] ...]
    python tests/every_grad_sync.py OUT_DIR NAME [flags...] :: cases   # then grad_sync_cases.py

Six lesson runs would pay the ranks' start-up (torch, scikit-learn, the process group) six times.
Here the lesson's guard_rails.start_ranks starts the ranks once and each joins the process group
once; then, for every group of flags and every mode in lesson.GRAD_SYNC, each rank calls the
lesson's own main(), which writes into OUT_DIR/NAME/<mode>/ what `train.py --grad-sync <mode>`
with those flags writes.
Every group must ask for the same --world-size. Rank 0 prints "== NAME <mode>" before each run.
A group named "cases", without flags, runs tests/grad_sync_cases.py's models on the same ranks
(2 of them) instead, into OUT_DIR/cases.json.

Two things a lesson run does not show, for the tests:
- before each mode's make_grad_sync, every rank but 0 adds its rank to its initial weights, as if
  it had built the model its own way; OUT_DIR/NAME/initial_weights.json holds, per mode, the
  largest difference from rank 0's weights over the ranks before make_grad_sync and after it;
- OUT_DIR/NAME/ddp/ddp_buckets.json: DDP's own buckets after its rebuild, as parameter names,
  from the logging data DDP keeps (_get_ddp_logging_data, which DDP's docstring shows).
"""

import copy
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import grad_sync_cases
import torch
import torch.distributed as dist

LESSON_DIR = Path(__file__).resolve().parent.parent / "08_ddp_from_scratch"
sys.path.insert(0, str(LESSON_DIR))  # where train.py finds guard_rails.py, model.py, data.py
spec = importlib.util.spec_from_file_location("lesson", LESSON_DIR / "train.py")
lesson = importlib.util.module_from_spec(spec)
sys.modules["lesson"] = lesson  # so that the ranks can unpickle the arguments
spec.loader.exec_module(lesson)
original_make_grad_sync = lesson.make_grad_sync
guard_rails = lesson.guard_rails  # the lesson's own, beside its train.py


def distance_from_rank_0(model):
    """The largest difference between any rank's parameters and rank 0's."""
    mine = torch.cat([param.detach().reshape(-1) for param in model.parameters()])
    rank_0 = mine.clone()
    dist.broadcast(rank_0, src=0)
    distance = (mine - rank_0).abs().max()
    dist.all_reduce(distance, op=dist.ReduceOp.MAX)
    return distance.item()


def run_every_mode(rank, groups, out_dir):
    first = groups[0][1]
    with guard_rails.rank_guard(rank, first):
        device = lesson.setup_process_group(rank, first.world_size, first.backend, first.timeout)
        lesson.setup_process_group = lambda *_: device  # joined once, above
        for name, args in groups:
            if name == "cases":
                grad_sync_cases.run_cases(lesson, rank, out_dir)
                continue
            initial, ddp = {}, {}

            def make_grad_sync(model, mode, bucket_mb, initial=initial, ddp=ddp):
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(rank)
                before = distance_from_rank_0(model)
                model, finish = original_make_grad_sync(model, mode, bucket_mb)
                initial[mode] = {"before": before, "after": distance_from_rank_0(model)}
                ddp["model"] = model
                return model, finish

            lesson.make_grad_sync = make_grad_sync
            for mode in lesson.GRAD_SYNC:
                run = copy.copy(args)
                run.grad_sync, run.out_dir = mode, str(out_dir / name / mode)
                if rank == 0:
                    print(f"== {name} {mode}", flush=True)
                lesson.main(rank, run)
                if mode == "ddp":
                    buckets = grad_sync_cases.ddp_buckets(ddp["model"])
            if rank == 0:
                (out_dir / name / "initial_weights.json").write_text(json.dumps(initial))
                (out_dir / name / "ddp" / "ddp_buckets.json").write_text(json.dumps(buckets))
        dist.destroy_process_group()


def main():
    out_dir, groups, words = Path(sys.argv[1]), [], [[]]
    for word in sys.argv[2:]:
        words.append([]) if word == "::" else words[-1].append(word)
    for name, *flags in words:
        if name == "cases":
            groups.append((name, None))
            continue
        args = lesson.parse_args(flags)
        args.start_time = time.time()
        args.backend = lesson.choose_backend(args.backend, args.world_size)
        groups.append((name, args))
        for mode in lesson.GRAD_SYNC:
            (out_dir / name / mode).mkdir(parents=True, exist_ok=True)
    if len({args.world_size if args else 2 for _, args in groups}) != 1:
        sys.exit("error: every group of flags needs the same --world-size (2 with cases)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(guard_rails.find_free_port()))
    with guard_rails.spawn_guard("rank"):
        guard_rails.start_ranks(run_every_mode, (groups, out_dir), groups[0][1].world_size,
                                ["torch._dynamo", "sklearn.datasets", "sklearn.model_selection",
                                 "sklearn.preprocessing"])


if __name__ == "__main__":
    main()
