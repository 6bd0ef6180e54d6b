"""Run lesson 10 for every schedule and layout, and lesson 08's references, on ranks started once.

    python tests/every_schedule.py OUT_DIR NAME [flags...] [:: NAME [flags...] ...]

Each NAME [flags...] is one run, which writes into OUT_DIR/NAME/ what `train.py flags --out-dir
OUT_DIR/NAME` writes. The flags are lesson 10's, but for two that this file reads itself:
  --lesson 08         the run is lesson 08's (08_ddp_from_scratch/train.py) instead
  --patch torch-loss  the control: torch's default loss handling (each micro-batch's mean loss,
                      and the library's scale_grads=True) in place of the lesson's loss_fn
  --measure           the run is lesson 10's measure_bubble.py (its flags too) instead
Two runs may share a NAME: the later one finds the earlier one's checkpoint and resumes it.

Thirty lesson runs would pay the ranks' start-up (Python, torch, scikit-learn) thirty times. Here
lesson 10's start_ranks starts the ranks once (4, or as many as the largest run needs), and each
run calls its lesson's own main() on the ranks it needs. For each run they join a process group of
its own, on a port of its own, through the lesson's setup_process_group (which also gives each rank
its share of the cores, from the run's world size), and leave it afterwards, as the lesson's
worker() does; what the lesson's launch() does before spawn (check_pipeline, the backend) is done
here.
  First the runs of 4 ranks, one after another, on all of them.
  Then, at the same time: the runs of 2 ranks on ranks 0 and 1, one after another, and the runs
  of 1 rank in turn on ranks 2 and 3 (with 2 ranks in all, on ranks 0 and 1).
So runs that share a NAME run in the order given. Rank 0 of each run prints "== NAME (t s)"
before it and "== NAME done (t s)" after it, t the seconds since this file started the ranks.
A run that fails stops every rank (start_ranks), with its traceback, and this file exits non-zero.
"""

import datetime
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
LESSONS = {"10": "10_pipeline_parallel", "08": "08_ddp_from_scratch"}  # guard rails: 10's
PATCHES = ("torch-loss",)
WAIT = datetime.timedelta(seconds=600)  # the longest a rank waits for its run's port


def import_train(number):
    """A lesson's train.py as module lesson<number>, importable by the ranks that spawn starts."""
    folder = ROOT / LESSONS[number]
    sys.path.insert(0, str(folder))  # where train.py finds guard_rails.py (the same in each)
    spec = importlib.util.spec_from_file_location(f"lesson{number}", folder / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"lesson{number}"] = module
    spec.loader.exec_module(module)
    return module


lesson = {number: import_train(number) for number in LESSONS}
sys.modules["train"] = lesson["10"]  # what measure_bubble.py imports: lesson 10's train.py
spec = importlib.util.spec_from_file_location("measure_bubble", ROOT / LESSONS["10"] /
                                              "measure_bubble.py")
lesson["measure"] = sys.modules["measure_bubble"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lesson["measure"])
guard_rails = sys.modules["guard_rails"]  # lesson 10's, which lesson 08's train.py uses too


def torch_default_loss(train):
    """The control, in lesson 10 (train): each micro-batch's mean loss, and scale_grads=True,
    which divides each micro-batch's gradients by --microbatches (the library's defaults).
    Right when every micro-batch holds as many real rows; wrong when padding makes them unequal.
    Returns what it replaced, for put_back."""
    def mean_loss(self, logits, targets):
        return F.cross_entropy(logits, targets, ignore_index=train.IGNORE)

    def scaled(schedule):
        return lambda *args, scale_grads, **kwargs: schedule(*args, scale_grads=True, **kwargs)

    pipeline = schedules_of(train)
    replaced = train.Trainer.loss_fn, pipeline.SCHEDULES
    train.Trainer.loss_fn = mean_loss
    pipeline.SCHEDULES = {name: scaled(schedule) for name, schedule in pipeline.SCHEDULES.items()}
    return replaced


def schedules_of(train):
    """The module whose SCHEDULES build_schedule reads: lesson 10's pipeline.py."""
    return sys.modules[train.build_schedule.__module__]


def put_back(train, replaced):
    train.Trainer.loss_fn, schedules_of(train).SCHEDULES = replaced


def parse_run(words, out_dir):
    """(name, lesson number, patch, args as the lesson's launch() makes them for mp.spawn)."""
    name, *flags = words
    number, patch = "10", None
    if "--measure" in flags:
        flags.remove("--measure")
        number = "measure"
    for option in ("--lesson", "--patch"):
        if option in flags:
            i = flags.index(option)
            value = flags[i + 1]
            del flags[i:i + 2]
            number, patch = (value, patch) if option == "--lesson" else (number, value)
    if number not in (*LESSONS, "measure") or patch not in (None, *PATCHES) or (
            patch and number != "10"):
        sys.exit(f"error: run {name}: --lesson {number} --patch {patch} is not one this file has")
    train = lesson[number]
    args = train.parse_args([*flags, "--out-dir", str(out_dir / name)])
    args.start_time = time.time()
    if number != "08":
        guard_rails.check_pipeline(args)  # --dp's default, and the flags' one-line errors
        args.world_size = args.dp * args.stages
    args.backend = lesson["10"].choose_backend(args.backend, args.world_size)
    os.makedirs(args.out_dir, exist_ok=True)
    return name, number, patch, args


def plan(runs, ranks):
    """The phases, one after another; each a list of lanes that run at the same time, each lane
    (its ranks, the indices of its runs in order)."""
    size = [args.world_size for *_, args in runs]
    if not set(size) <= {1, 2, 4}:
        sys.exit("error: every run needs 1, 2 or 4 ranks")
    twos = [i for i, n in enumerate(size) if n == 2 < ranks]
    ones = [i for i, n in enumerate(size) if n == 1 < ranks]
    singles = list(range(2 if twos else 0, ranks))
    later = [((0, 1), twos)] if twos else []
    later += [((r,), ones[k::len(singles)]) for k, r in enumerate(singles)]
    return [[(tuple(range(ranks)), [i for i, n in enumerate(size) if n == ranks])], later]


def run_everything(rank, runs, ranks, store_port, started):
    # The ranks of a run meet on a port that its first rank picks just before the run (so that
    # no other program takes it meanwhile) and hands to the others through this store.
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=WAIT)
    for phase in plan(runs, ranks):
        for lane, indices in phase:
            if rank not in lane:
                continue
            local = lane.index(rank)  # this rank's rank in the run
            for i in indices:
                name, number, patch, args = runs[i]
                train = lesson[number]
                if local == 0:
                    store.set(f"port {i}", str(guard_rails.find_free_port()))
                    print(f"== {name} ({time.time() - started:.1f} s)", flush=True)
                os.environ["MASTER_PORT"] = store.get(f"port {i}").decode()
                replaced = torch_default_loss(train) if patch else None
                train.main(local, args)
                dist.destroy_process_group()
                if replaced:
                    put_back(train, replaced)
                if local == 0:
                    print(f"== {name} done ({time.time() - started:.1f} s)", flush=True)


def main():
    out_dir, words = Path(sys.argv[1]), [[]]
    for word in sys.argv[2:]:
        words.append([]) if word == "::" else words[-1].append(word)
    runs = [parse_run(run, out_dir) for run in words if run]
    ranks = max(args.world_size for *_, args in runs)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=WAIT)
    guard_rails.start_ranks(run_everything, (runs, ranks, store.port, time.time()), ranks)
    guard_rails.leave_quickly()  # the lessons' own: its fork server goes now


if __name__ == "__main__":
    main()
