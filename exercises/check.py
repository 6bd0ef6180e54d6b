"""Check an exercise: run your script as the lesson runs, compare with the lesson, name the mistake.

    python exercises/check.py 02 my_02/train.py

It runs your script and the lesson's with the same small flags (on the CPU with gloo, whatever the
machine has), each run bounded in time, and compares what they wrote (final.pt, metrics.json) and
what each rank did (recorded by exercises/probe/sitecustomize.py: the wines each step read, the
weights before each step, the files it loaded and saved). It prints one verdict line and, when your
run differs, the most likely mistake, decided from what it measured, and where to look. Everything
it writes goes into one temporary folder, removed at the end. Exercises 09 (tensor parallelism)
and 10 (a pipeline) add checks of their own: check_tp.py and check_pp.py. Exercise 11 (the ring's
merge) checks your ring_attention.py against full attention instead: check_cp.py; exercise 12
(the dispatch and combine) your experts.py against every expert run on every token: check_ep.py;
exercise 13 (which dimension is wrong) your copy of lesson 13's 3-D step on five layouts against
one process: check_3d.py.

Exit status: 0 your script passes, 1 it runs but differs (the mistake is named), 2 it could not be
checked (no such script, it failed, it hung, it wrote nothing or files in another shape).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import check_cp
import check_ep
import check_pp
import check_tp
from verdicts import TOLERANCE, Mistake, Unchecked, free_port, readme, same

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "exercises", "probe")


@dataclass
class Exercise:
    title: str
    page: str  # the exercise's page, under exercises/
    lesson: str  # the solution: the lesson whose run is the reference
    flags: list  # what both runs are given, besides --out-dir
    world_size: int  # ranks that must train
    nodes: int = 1  # 2: two "nodes" on this machine, lesson 03's way
    resume: bool = False  # lesson 04's way: a run that crashes, then the same command again
    without: str = ""  # a module class the exercise takes out, which your run must not use
    layout: str = "data"  # what a rank holds: the whole model ("data"), a slice of each layer
    # ("tensor": check_tp.py's checks), or some of the layers ("pipeline": check_pp.py's); or
    # "split": one stage's backward split in two, alone (check_pp.py's check_split);
    # "context": the ring attention alone, checked by check_cp.py; "experts": the mixture of
    # experts' dispatch and combine alone, checked by check_ep.py; "3d": lesson 13's step on
    # five layouts, checked by check_3d.py
    passes: str = "your script ends where {lesson} does, on every check"  # the PASS line's end


SMALL = ["--epochs", "2", "--batch-size", "16"]
EXERCISES = {
    # 5 ranks: 142 training and 36 test wines do not split evenly, so the samplers pad.
    "02": Exercise("make lesson 01 data-parallel with DDP and mp.spawn", "02_ddp_with_spawn.md",
                   "02_multi_gpu_spawn", ["--world-size", "5", *SMALL], world_size=5),
    # --timeout 40: ranks that cannot all meet (two of them asking for one rank) give up soon.
    "03": Exercise("global ranks across two nodes", "03_global_ranks.md", "03_multi_node",
                   ["--nnodes", "2", "--nproc-per-node", "2", "--timeout", "40", *SMALL],
                   world_size=4, nodes=2),
    "04": Exercise("a rank-0 snapshot, and a resume that loses nothing", "04_snapshot_resume.md",
                   "04_checkpointing", ["--world-size", "2", "--epochs", "4", "--batch-size", "16",
                                        "--save-every", "1", "--crash-at-epoch", "3"],
                   world_size=2, resume=True),
    "07": Exercise("lesson 02 with FSDP2", "07_fsdp2.md", "07_sharding",
                   ["--world-size", "2", *SMALL], world_size=2),
    # 3 ranks: a sum, or a division by 2, is not the average.
    "08": Exercise("average the gradients yourself", "08_average_by_hand.md", "02_multi_gpu_spawn",
                   ["--world-size", "3", *SMALL], world_size=3,
                   without="DistributedDataParallel"),
    # 2 TP groups of 2: the ranks of a group read alike, the groups apart.
    "09": Exercise("tensor parallelism, with FSDP across it", "09_tensor_parallel.md",
                   "09_tensor_parallel", ["--dp", "2", "--tp", "2", *SMALL], world_size=4,
                   layout="tensor"),
    # 4 micro-batches of 4: the last batch of an epoch (14 wines) fills them 4, 4, 4 and 2.
    # --timeout 20: a deadlocked pipeline's ranks give up soon.
    "10": Exercise("a pipeline, scheduled by hand", "10_pipeline_by_hand.md",
                   "10_pipeline_parallel", ["--schedule", "afab", "--stages", "2",
                                            "--microbatches", "4", "--layers", "3",
                                            "--timeout", "20", *SMALL],
                   world_size=2, layout="pipeline"),
    # Part two: your split_backward.py (beside the script named), B and W on one stage, on one
    # process, against one ordinary backward.
    "10b": Exercise("the backward split in two", "10_pipeline_by_hand.md#part-two-the-backward-"
                    "split-in-two", "10_pipeline_parallel", [], world_size=1, layout="split",
                    passes="your B and W add up to one backward, on every check"),
    # Your ring_attention.py (beside the script named), against full attention; then at 4 ranks.
    "11": Exercise("the ring's causal mask and merge", "11_ring_merge.md", "11_context_parallel",
                   [], world_size=4, layout="context",
                   passes="your ring attention equals full attention, on every check"),
    # Your experts.py (beside the script named), against every expert on every token, on one
    # process; then at --ep 2 and 4, with 2 experts per rank.
    "12": Exercise("the dispatch and combine", "12_dispatch_and_combine.md",
                   "12_expert_parallel", [], world_size=4, layout="experts",
                   passes="your mixture of experts equals every expert run on every token, on "
                          "every check"),
    # Your copy of lesson 13 (the script's folder), on 1 x 1 x 1, each dimension at 2 alone, and
    # 2 x 2 x 2: 8 ranks, started once, against one process.
    "13": Exercise("which dimension is wrong", "13_which_dimension.md", "13_capstone", [],
                   world_size=8, layout="3d",
                   passes="every layout of your 3-D step equals one process, on every check"),
    # Your layout of Llama 3 70B on 64 GPUs (a JSON file), measured by lesson 14's planner.
    "14": Exercise("choose a layout", "14_choose_a_layout.md", "14_planning", [], world_size=64,
                   layout="plan", passes="your layout fits, with TP inside a node"),
}
# Lesson 07's own flag that picks what the exercise builds: FSDP2.
LESSON_ONLY_FLAGS = {"07_sharding": ["--strategy", "fsdp"]}


# ---------------------------------------------------------------------------------------------
# Running a script, bounded in time, with the probe in every process
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    code: int  # the exit status; None: still running at the time bound, and killed
    output: str
    out_dir: str
    ranks: list = field(default_factory=list)  # the probe's record of each process that trained
    # or touched a file
    joined: list = field(default_factory=list)  # (rank, world_size) each process joined with
    p2p: dict = field(default_factory=dict)  # {rank: [each send and recv it began, in order]}

    def last_line(self):
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(it printed nothing)"


def start(script, flags, out_dir, probe_dir, cwd):
    os.makedirs(probe_dir, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=PROBE,
               EXERCISE_PROBE_DIR=probe_dir, EXERCISE_SCRIPT=script, PYTHONUNBUFFERED="1")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)  # a launcher's leftovers would change how the script starts
    # Its own session: at the time bound, the script and every rank it started are killed.
    return subprocess.Popen([sys.executable, script, *flags, "--out-dir", out_dir], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(process, deadline):
    """The exit status (None: killed at the deadline) and the output."""
    try:
        output, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return None, process.communicate()[0]


def run(script, exercise, folder, timeout, extra=()):
    """Run script with the exercise's flags: once, or as two nodes started together."""
    out_dir, probe_dir = os.path.join(folder, "out"), os.path.join(folder, "probe")
    flags = [*exercise.flags, *extra]
    if exercise.nodes == 1:
        processes = [start(script, flags, out_dir, probe_dir, folder)]
    else:
        port = str(free_port())
        processes = [start(script, [*flags, "--node-rank", str(node), "--master-port", port],
                           out_dir, probe_dir, folder) for node in range(exercise.nodes)]
    deadline = time.monotonic() + timeout
    try:
        results = [finish(process, deadline) for process in processes]
    finally:  # also on Ctrl-C: nothing of the run is left running
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    codes = [code for code, _ in results]
    code = None if None in codes else max(codes, key=abs)
    result = Run(code, "\n".join(output for _, output in results), out_dir)
    for name in sorted(os.listdir(probe_dir)):
        path = os.path.join(probe_dir, name)
        if name.endswith(".json"):
            with open(path) as f:
                joined = json.load(f)
            result.joined.append((joined["rank"], joined["world_size"]))
        elif name.endswith(".pt"):
            result.ranks.append(torch.load(path, weights_only=True))
        elif name.endswith(".p2p"):
            with open(path) as f:
                check_pp.read_p2p(f, result.p2p)
    result.ranks.sort(key=lambda log: (log["rank"] is None, log["rank"] or 0))
    shutil.rmtree(probe_dir)  # a resumed run's processes write their own
    return result


# ---------------------------------------------------------------------------------------------
# What a run wrote, and the wines its steps read
# ---------------------------------------------------------------------------------------------
def load_lesson(lesson):
    """The lesson's train.py as a module: its data and its model class."""
    folder = os.path.join(ROOT, lesson)
    sys.path.insert(0, folder)  # its `import guard_rails`
    spec = importlib.util.spec_from_file_location(f"lesson_{lesson[:2]}", f"{folder}/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.path.remove(folder)
    return module


class Wines:
    """Tells which training or test wine a row of features is, by its exact bytes."""

    def __init__(self, lesson_module):
        train, test = lesson_module.load_data()
        self.train_size, self.test_size = len(train), len(test)
        self.train = {row.numpy().tobytes(): i for i, row in enumerate(train.features)}
        self.test = {row.numpy().tobytes(): i for i, row in enumerate(test.features)}
        self.train_set, self.test_set = train, test

    def ids(self, rows, table):
        return [table.get(row.numpy().tobytes()) for row in rows]


def read_outputs(result, who):
    """final.pt and metrics.json, or Unchecked naming what is missing or of another shape."""
    path = os.path.join(result.out_dir, "final.pt")
    if not os.path.isfile(path):
        raise Unchecked(f"{who} wrote no final.pt into --out-dir: rank 0 saves the model's "
                        f"weights there at the end, as lesson 01 does")
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        if "DTensor" in str(error):
            raise Mistake(f"{who}'s final.pt holds DTensors", "it saved each rank's shards: "
                          "gather the whole tensors first (get_model_state_dict with "
                          "full_state_dict=True, cpu_offload=True)",
                          readme("07_sharding", "the-sharded-checkpoint")) from None
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise Unchecked(f"{who}'s final.pt is not a file of plain tensors that torch.load("
                        f"weights_only=True) reads ({first}): save a state_dict") from None
    if not isinstance(weights, dict) or not all(torch.is_tensor(t) for t in weights.values()):
        raise Unchecked(f"{who}'s final.pt holds a {type(weights).__name__}, not a state_dict "
                        "(a dict of names to tensors): save model.state_dict()")
    path = os.path.join(result.out_dir, "metrics.json")
    try:
        with open(path) as f:
            metrics = json.load(f)
        metrics = {key: metrics[key] for key in ("train_loss", "test_correct", "test_total")}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise Unchecked(f"{who}'s metrics.json is missing or lacks train_loss, test_correct and "
                        f"test_total ({type(error).__name__}: {error}): write them as lesson 01 "
                        "does") from None
    return weights, metrics


# ---------------------------------------------------------------------------------------------
# The diagnosis: evidence first, each with the mistake it points to
# ---------------------------------------------------------------------------------------------
def check_files(weights, reference):
    if any(key.startswith("module.") for key in weights):
        raise Mistake("final.pt's keys start with 'module.'",
                      "it saved the DDP wrapper's state_dict, which a plain WineMLP cannot load; "
                      "save model.module.state_dict()",
                      readme("02_multi_gpu_spawn", "rank-0-prints-and-writes-the-figures-cover-"
                             "every-rank"))
    if set(weights) != set(reference):
        raise Mistake(f"final.pt holds {sorted(weights)}, the lesson's {sorted(reference)}",
                      "it saved another model, or another module of it", "the lesson's main()")
    for name, tensor in weights.items():
        if tensor.shape != reference[name].shape:
            raise Mistake(f"final.pt's {name} has shape {tuple(tensor.shape)}, the whole "
                          f"model's {tuple(reference[name].shape)}",
                          "it saved one rank's shard: gather the whole tensors first "
                          "(get_model_state_dict with full_state_dict=True, cpu_offload=True)",
                          readme("07_sharding", "the-sharded-checkpoint"))


def check_joined(yours, exercise):
    """Who each process asked to join as: known even when the run then hung or failed."""
    sizes = sorted({size for _, size in yours.joined})
    if yours.joined and sizes != [exercise.world_size]:
        raise Mistake(f"{len(yours.joined)} processes joined groups of world size "
                      f"{', '.join(map(str, sizes))}, not {exercise.world_size}",
                      "the world size is every rank of every node: nnodes * nproc_per_node",
                      readme("03_multi_node", "the-rank-arithmetic-2-nodes--2-gpus"))
    ranks = sorted(rank for rank, _ in yours.joined)
    twice = sorted({rank for rank in ranks if ranks.count(rank) > 1})
    if twice:
        raise Mistake(f"two processes joined as rank {twice[0]} (the ranks asked for: "
                      f"{', '.join(map(str, ranks))})",
                      "each rank 0 .. world_size - 1 must appear once: the global rank is "
                      "node_rank * nproc_per_node + local_rank",
                      readme("03_multi_node", "the-rank-arithmetic-2-nodes--2-gpus"))


def check_ranks(yours, exercise):
    trained = [log for log in yours.ranks if log["steps"]]
    if not trained:
        raise Mistake("no process of your run took an optimizer step",
                      "train as the lesson does: optimizer.step() after each backward",
                      "the lesson's Trainer")
    ranks = sorted(log["rank"] for log in trained if log["rank"] is not None)
    if len(trained) == 1 and exercise.world_size > 1:
        raise Mistake(f"one process trained, not {exercise.world_size}",
                      "start one process per rank (mp.spawn(worker, nprocs=world_size)), each "
                      "joining the process group", readme("02_multi_gpu_spawn",
                                                          "ranks-started-by-mpspawn"))
    sizes = sorted({log["world_size"] for log in trained})
    if sizes != [exercise.world_size]:
        raise Mistake(f"{len(trained)} processes trained in groups of world size {sizes}, "
                      f"not {exercise.world_size}",
                      "the world size is every rank of every node: nnodes * nproc_per_node",
                      readme("03_multi_node", "the-rank-arithmetic-2-nodes--2-gpus"))
    if ranks != list(range(exercise.world_size)):
        raise Mistake(f"the processes that trained had ranks {ranks}",
                      "each rank 0 .. world_size - 1 must appear once: the global rank is "
                      "node_rank * nproc_per_node + local_rank",
                      readme("03_multi_node", "the-rank-arithmetic-2-nodes--2-gpus"))
    return trained


def check_writers(logs):
    """Only global rank 0 writes: on a shared disk, another rank's copy overwrites it."""
    for log in logs:
        if log["rank"] not in (0, None) and log["saves"]:
            name = os.path.basename(log["saves"][0]).removesuffix(".tmp")
            raise Mistake(f"rank {log['rank']} wrote {name} too",
                          "only global rank 0 writes; decided by the local rank, the first rank "
                          "of every node writes, and on a shared disk they overwrite each other",
                          readme("04_checkpointing", "why-rank-0-alone-writes-and-the-barrier"))


def check_sharding(trained, lesson_trained):
    """fully_shard on each layer, then the root, as the lesson does: a sharded module's class
    becomes FSDP<its class>, and the probe saw which ones ran."""
    units = sorted(name for name in trained[0]["layers"] if name.startswith("FSDP"))
    lesson_units = sorted(name for name in lesson_trained[0]["layers"] if name.startswith("FSDP"))
    if units != lesson_units:
        raise Mistake(f"fully_shard reached {units or 'no module'}, the lesson's {lesson_units}",
                      "call fully_shard on each layer first, then on the whole model: with the "
                      "root alone, every forward gathers the whole model at once",
                      readme("07_sharding", "who-holds-what"))


def check_resume(trained, lesson_trained):
    """The second run loads the snapshot safely, onto its own device, and goes on from it."""
    for log in trained:
        for load in log["loads"]:
            if load["weights_only"] is False:
                raise Mistake(f"rank {log['rank']} loaded {os.path.basename(load['file'])} "
                              "with weights_only=False",
                              "load with weights_only=True: a file that holds more than tensors "
                              "can run code as it is loaded", readme(
                                  "04_checkpointing", "loading-map_location-and-weights_onlytrue"))
            if load["map_location"] == "None":
                raise Mistake(f"rank {log['rank']} loaded {os.path.basename(load['file'])} "
                              "without map_location", "give map_location=device: without it, "
                              "every tensor goes back to the device it was saved from, rank 0's "
                              "GPU, on every rank", readme(
                                  "04_checkpointing", "loading-map_location-and-weights_onlytrue"))
    steps, lesson_steps = len(trained[0]["steps"]), len(lesson_trained[0]["steps"])
    if steps > lesson_steps:
        raise Mistake(f"after the crash, your second run took {steps} steps, the lesson's "
                      f"{lesson_steps}", "it started over instead of resuming: load the snapshot "
                      "and start at its epochs_completed", readme(
                          "04_checkpointing", "a-resume-continues-the-same-run-or-says-why-not"))
    if steps < lesson_steps:
        raise Mistake(f"after the crash, your second run took {steps} steps, the lesson's "
                      f"{lesson_steps}", "it skipped an epoch: epochs_completed is the number "
                      "of epochs done, so training goes on at that index (range(done, epochs))",
                      readme("04_checkpointing",
                             "a-resume-continues-the-same-run-or-says-why-not"))
    if not same(trained[0]["params"][0], lesson_trained[0]["params"][0]):
        raise Mistake("your resumed run did not start from the snapshot's weights",
                      "load the model's state_dict from the snapshot before training",
                      readme("04_checkpointing", "what-is-in-a-snapshot-and-why-each-piece"))
    second = trained[0]["params"][1] if steps > 1 else trained[0]["last"]
    lesson_second = lesson_trained[0]["params"][1] if steps > 1 else lesson_trained[0]["last"]
    if not same(second, lesson_second):
        raise Mistake("your resumed run started from the snapshot's weights, but its first step "
                      "went elsewhere", "restore the optimizer's state too: Adam's running "
                      "averages of each gradient are in optimizer.state_dict()",
                      readme("04_checkpointing", "what-is-in-a-snapshot-and-why-each-piece"))


def epochs_of(log, wines, per_epoch):
    """The training wines each epoch of this rank read, in order."""
    ids = [i for step in log["steps"] for i in wines.ids(step, wines.train)]
    return [ids[start:start + per_epoch] for start in range(0, len(ids), per_epoch)]


def check_data(trained, wines, epochs, lesson_rows_per_epoch):
    """Each rank its own slice (with the sampler's padding), a new order every epoch."""
    for log in trained:
        steps = [wines.ids(step, wines.train) for step in log["steps"]]
        if any(None in step for step in steps):
            raise Mistake(f"rank {log['rank']} trained on rows that are not the lesson's "
                          "training wines", "keep the lesson's load_data: the same split and "
                          "scaling", "the lesson's load_data()")
        rows = sum(len(step) for step in steps)
        if rows == epochs * wines.train_size and lesson_rows_per_epoch < wines.train_size:
            raise Mistake(f"rank {log['rank']} read all {wines.train_size} training wines in "
                          f"each of {epochs} epochs",
                          "every rank trains on the whole set: give the DataLoader a "
                          "DistributedSampler, so that each rank reads its own slice",
                          readme("02_multi_gpu_spawn",
                                 "each-rank-its-own-slice-distributedsampler-and-set_epoch"))
        if rows != epochs * lesson_rows_per_epoch:
            # No listed mistake reads this many (a sampler of one rank, above, reads them all):
            # say what differs and where, not a cause this count does not single out.
            raise Mistake(f"rank {log['rank']} read {rows} training wines in {epochs} epochs, "
                          f"the lesson's ranks {epochs * lesson_rows_per_epoch}",
                          "your training loader deals or batches the wines otherwise than the "
                          "lesson's: compare its sampler (num_replicas the world size, rank the "
                          "global rank), --batch-size (per rank) and the DataLoader's other "
                          "arguments", "the lesson's prepare_dataloader()")
    per_rank = [epochs_of(log, wines, lesson_rows_per_epoch) for log in trained]
    for epoch in range(epochs):
        seen = [set(ranks[epoch]) for ranks in per_rank]
        padding = len(trained) * lesson_rows_per_epoch - wines.train_size
        if sum(map(len, seen)) - len(set().union(*seen)) > padding:
            shared = [(a["rank"], b["rank"]) for i, a in enumerate(trained)
                      for j, b in enumerate(trained) if i < j and seen[i] & seen[j]]
            raise Mistake(f"in epoch {epoch + 1}, ranks {shared[0][0]} and {shared[0][1]} "
                          "trained on the same wines",
                          "each rank needs its own slice: the sampler's rank is the global "
                          "rank, and num_replicas the world size",
                          readme("03_multi_node", "the-rank-arithmetic-2-nodes--2-gpus"))
    if epochs > 1 and all(ranks[0] == ranks[1] for ranks in per_rank):
        raise Mistake("every epoch read the wines in the same order",
                      "call train_loader.sampler.set_epoch(epoch) at the start of each epoch",
                      readme("02_multi_gpu_spawn",
                             "each-rank-its-own-slice-distributedsampler-and-set_epoch"))


def own_gradients(module, params, rows, wines):
    """The gradients one rank's batch gives on its own, at the weights params."""
    model = module.WineMLP()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params, strict=True):
            p.copy_(value)
    labels = wines.train_set.labels[wines.ids(rows, wines.train)]
    F.cross_entropy(model(rows), labels).backward()
    return [p.grad for p in model.parameters()]


def check_averaging(trained, lesson_trained, module, wines):
    """The same first weights on every rank, then each step the mean of the ranks' gradients."""
    names, shapes = zip(*[(n, p.shape) for n, p in module.WineMLP().named_parameters()],
                        strict=True)
    first = [log["params"][0] for log in trained]
    if len(first[0]) != len(shapes):
        raise Mistake(f"your optimizer steps {len(first[0])} tensors, the lesson's model has "
                      f"{len(shapes)}", "keep the lesson's model, and give the optimizer all of "
                      "its parameters", "the lesson's WineMLP and main()")
    if any(p.shape != shape for p, shape in zip(first[0], shapes, strict=True)):
        # Sharded (FSDP): each rank holds a slice of dim 0; together, in rank order, the whole.
        whole = [torch.cat(pieces) for pieces in zip(*first, strict=True)]
        lesson_first = [log["params"][0] for log in lesson_trained]
        lesson_whole = [torch.cat(pieces) for pieces in zip(*lesson_first, strict=True)]
        if not same(whole, lesson_whole):
            raise Mistake("the model's first weights, put together from the ranks' shards, are "
                          "not the lesson's", "every rank must build the model from the same "
                          "seed before fully_shard: FSDP does not broadcast rank 0's weights",
                          readme("07_sharding", "the-same-steps-less-held"))
        return
    if not all(same(first[0], other) for other in first[1:]):
        raise Mistake("the ranks started from different weights",
                      "every rank must start from rank 0's weights: broadcast them from rank 0 "
                      "before the first step (DDP does it when it wraps the model)",
                      readme("08_ddp_from_scratch", "averaging-by-hand-after-backward"))
    own = [own_gradients(module, first[0], log["steps"][0], wines) for log in trained]
    mean = [sum(grads) / len(own) for grads in zip(*own, strict=True)]
    total = [sum(grads) for grads in zip(*own, strict=True)]
    for log in trained:
        alone_grads = own[trained.index(log)]
        for name, got, want, summed, alone in zip(names, log["grads"][0], mean, total, alone_grads,
                                                  strict=True):
            if torch.allclose(got, want, rtol=1e-4, atol=TOLERANCE):
                continue
            if torch.allclose(got, summed, rtol=1e-4, atol=TOLERANCE):
                mistake = "summed, not averaged: divide each gradient by the world size"
            elif torch.allclose(got, alone, rtol=1e-4, atol=TOLERANCE):
                mistake = ("not averaged at all: each rank stepped with its own batch's "
                           "gradient; DDP, or an all-reduce of every gradient, averages them")
            else:
                mistake = "neither the mean of the ranks' gradients, nor their sum"
            raise Mistake(f"rank {log['rank']}'s first step used a gradient of {name} that is "
                          f"{mistake.split(':')[0]}", mistake,
                          readme("08_ddp_from_scratch", "averaging-by-hand-after-backward"))
    last = [log["last"] for log in trained]
    if not all(same(last[0], other) for other in last[1:]):
        raise Mistake("the ranks ended with different weights", "some steps or some gradients "
                      "were not averaged over the ranks",
                      readme("02_multi_gpu_spawn",
                             "ddp-averages-the-gradients-2-ranks--batch-16--1-rank--batch-32"))


def check_evaluation(yours, metrics, wines):
    """Each test wine counted once, over every rank."""
    trained = [log for log in yours.ranks if log["rank"] is not None]
    evaluated = [wines.ids(torch_cat(log["eval_rows"]), wines.test) for log in trained]
    counted = sum(len(ids) for ids in evaluated)
    total = metrics["test_total"]
    if total == wines.test_size:
        return
    if len(evaluated) > 1 and all(len(set(ids)) == wines.test_size for ids in evaluated):
        raise Mistake(f"metrics.json counts {total} test wines; there are {wines.test_size}, "
                      f"and each of the {len(evaluated)} ranks evaluated all of them",
                      "give each rank its own part of the test set, a stride "
                      "(test_set.features[rank::world_size]), then sum the counts",
                      readme("02_multi_gpu_spawn", "evaluation-counts-every-test-wine-once"))
    if counted > wines.test_size and len(set().union(*map(set, evaluated))) == wines.test_size:
        raise Mistake(f"metrics.json counts {total} test wines; there are {wines.test_size}",
                      "the padding of a DistributedSampler was counted: it repeats wines so that "
                      "every rank gets as many; give each rank a stride of the test set instead",
                      readme("02_multi_gpu_spawn", "evaluation-counts-every-test-wine-once"))
    if trained and total == len(evaluated[0]):
        raise Mistake(f"metrics.json counts {total} test wines, rank 0's share of "
                      f"{wines.test_size}", "the counts were not summed over the ranks: "
                      "all_reduce the (correct, total) tensor", readme(
                          "02_multi_gpu_spawn", "evaluation-counts-every-test-wine-once"))
    raise Mistake(f"metrics.json counts {total} test wines; there are {wines.test_size}",
                  "count every test wine once, over all ranks",
                  readme("02_multi_gpu_spawn", "evaluation-counts-every-test-wine-once"))


def torch_cat(rows):
    return torch.cat(rows) if rows else torch.empty(0, 13)


def rank_0_loss(log, module, wines, steps_per_epoch):
    """The mean loss over rank 0's own samples, epoch by epoch, from its recorded steps."""
    model, losses = module.WineMLP(), []
    for start_step in range(0, len(log["steps"]), steps_per_epoch):
        total = count = 0.0
        for step in range(start_step, start_step + steps_per_epoch):
            with torch.no_grad():
                for p, value in zip(model.parameters(), log["params"][step], strict=True):
                    p.copy_(value)
                rows = log["steps"][step]
                labels = wines.train_set.labels[wines.ids(rows, wines.train)]
                total += F.cross_entropy(model(rows), labels).item() * len(rows)
                count += len(rows)
        losses.append(total / count)
    return losses


def compare(weights, metrics, reference, reference_metrics, trained, module, wines,
            steps_per_epoch, exercise):
    difference = max((weights[name] - reference[name]).abs().max().item() for name in reference)
    if difference > TOLERANCE:
        raise Mistake(f"your final weights differ from the lesson's by up to {difference:.2g} "
                      f"(tolerance {TOLERANCE:g})", "the data, its order and the averaging look "
                      "right: compare your training step and its flags (--lr, --seed, the loss, "
                      "the optimizer) with the lesson's", "the lesson's train_step()")
    losses, lesson_losses = metrics["train_loss"], reference_metrics["train_loss"]
    if len(losses) != len(lesson_losses) or not torch.allclose(
            torch.tensor(losses), torch.tensor(lesson_losses), rtol=0, atol=TOLERANCE):
        if exercise.layout == "pipeline":
            check_pp.check_loss_figure(losses, lesson_losses, wines, steps_per_epoch, exercise)
        whole = exercise.layout == "data" and all(
            p.shape == q.shape for p, q in zip(trained[0]["params"][0],
                                               module.WineMLP().parameters(), strict=True))
        rank_0 = rank_0_loss(trained[0], module, wines, steps_per_epoch) if whole else None
        if rank_0 and len(rank_0) == len(losses) and torch.allclose(
                torch.tensor(losses), torch.tensor(rank_0), rtol=0, atol=1e-4):
            raise Mistake("the weights match the lesson's, but the train_loss in metrics.json "
                          "is rank 0's own", "sum the losses and the sample counts over the "
                          "ranks (all_reduce) before dividing",
                          readme("02_multi_gpu_spawn",
                                 "rank-0-prints-and-writes-the-figures-cover-every-rank"))
        raise Mistake(f"the weights match the lesson's, but train_loss is {losses}, the "
                      f"lesson's {lesson_losses}", "each epoch's loss is the mean over every "
                      "rank's samples", readme("02_multi_gpu_spawn",
                                               "rank-0-prints-and-writes-the-figures-cover-"
                                               "every-rank"))
    if metrics["test_correct"] != reference_metrics["test_correct"]:
        raise Mistake(f"the weights match the lesson's, but test_correct is "
                      f"{metrics['test_correct']}, the lesson's "
                      f"{reference_metrics['test_correct']}", "count the correct predictions "
                      "of every test wine once, over all ranks",
                      readme("02_multi_gpu_spawn", "evaluation-counts-every-test-wine-once"))


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------
def check_run(result, who, crash=False):
    if crash and result.code == 0:
        raise Unchecked(f"{who} finished without an error: the last rank must raise at the "
                        "start of that epoch, in a run that did not resume")
    if crash and result.code is not None and any(log["steps"] for log in result.ranks):
        return  # it trained, then stopped with an error: the crash asked for
    if result.code is None:
        raise Unchecked(f"{who} did not finish within the time bound and was stopped; its last "
                        f"line: {result.last_line()} (a rank that waits for ranks that never "
                        "come: does every rank join, with the same world size?)")
    if result.code != 0:
        raise Unchecked(f"{who} stopped with exit status {result.code}; its last line: "
                        f"{result.last_line()}")


def run_script(exercise, path, folder, timeout, flags=()):
    """One run of a script as the exercise asks: for lesson 04, a run that crashes at
    --crash-at-epoch, then the same command again, which resumes."""
    os.makedirs(folder)
    if not exercise.resume:
        return run(path, exercise, folder, timeout, flags)
    crashed = run(path, exercise, folder, timeout, flags)
    check_run(crashed, "the run with --crash-at-epoch", crash=True)
    return run(path, exercise, folder, timeout, flags)


def run_lesson(exercise, folder, timeout):
    """The lesson's run of the same flags; EXERCISE_LESSON_RUNS (set by the tests) keeps it
    in that folder, to be reused by the next check of the same exercise."""
    cache = os.environ.get("EXERCISE_LESSON_RUNS")
    name = f"{exercise.lesson}-{'-'.join(exercise.flags)}"
    if cache and os.path.isfile(os.path.join(cache, name, "run.pt")):
        return Run(**torch.load(os.path.join(cache, name, "run.pt"), weights_only=True))
    folder = os.path.join(cache, name) if cache else os.path.join(folder, "lesson")
    lesson = run_script(exercise, os.path.join(ROOT, exercise.lesson, "train.py"), folder,
                        timeout, LESSON_ONLY_FLAGS.get(exercise.lesson, []))
    if lesson.code != 0:
        raise RuntimeError(f"the lesson itself failed:\n{lesson.output}")
    if cache:
        torch.save(vars(lesson), os.path.join(folder, "run.pt"))
    return lesson


def check(exercise, script, timeout):
    """Run your script and the lesson's; raise Unchecked or the first Mistake seen, if any."""
    folder = tempfile.mkdtemp(prefix="exercise-check-")
    # Every file the runs write, torch's caches too, goes into this folder, removed at the end.
    os.environ["TMPDIR"] = tempfile.tempdir = os.path.join(folder, "tmp")
    os.mkdir(tempfile.tempdir)
    try:
        if exercise.layout == "split":
            return check_pp.check_split(script)
        if exercise.layout == "context":
            return check_cp.check(script, folder, timeout)
        if exercise.layout == "experts":
            return check_ep.check(script, folder, timeout)
        if exercise.layout == "3d":
            import check_3d  # only exercise 13 needs it (and pyproject's isort list lacks it)

            return check_3d.check(script, folder, timeout)
        if exercise.layout == "plan":
            import check_plan  # only exercise 14 needs it (and pyproject's isort list lacks it)

            return check_plan.check(script, folder, timeout)
        yours = run_script(exercise, script, os.path.join(folder, "yours"), timeout)
        check_joined(yours, exercise)
        check_writers(yours.ranks)  # these hold even for a run that then failed, and so do
        if exercise.layout == "tensor":
            check_tp.check_plan(yours)  # how the first forward found each layer split
        if exercise.layout == "pipeline":
            check_pp.check_deadlock(yours, exercise)  # the sends and recvs begun
        check_run(yours, "your script")
        weights, metrics = read_outputs(yours, "your script")
        lesson = run_lesson(exercise, folder, timeout)
        reference, reference_metrics = read_outputs(lesson, "the lesson")
        module = load_lesson(exercise.lesson)
        wines = Wines(module)
        check_files(weights, reference)
        trained = check_ranks(yours, exercise)
        if exercise.without in trained[0]["layers"]:
            raise Mistake(f"your script still wraps the model in {exercise.without}",
                          "this exercise takes it out: average the gradients yourself",
                          f"exercises/{exercise.page}")
        lesson_trained = [log for log in lesson.ranks if log["steps"]]
        epochs = len(reference_metrics["train_loss"]) - (2 if exercise.resume else 0)
        # The rows one rank of the lesson read (a pipeline's first stage: padding left out).
        reader = check_pp.without_padding(lesson_trained[:1])[0]
        rows_per_epoch = sum(len(step) for step in reader["steps"]) // epochs
        steps_per_epoch = len(reader["steps"]) // epochs
        check_sharding(trained, lesson_trained)
        if exercise.resume:
            check_resume(trained, lesson_trained)
        if exercise.layout == "data":
            check_data(trained, wines, epochs, rows_per_epoch)
            check_averaging(trained, lesson_trained, module, wines)
            check_evaluation(yours, metrics, wines)
        elif exercise.layout == "tensor":
            groups = check_tp.tp_groups(trained)
            check_tp.check_group_reads(trained, groups, wines)
            # One rank of each TP group, as the data-parallel ranks they are to each other.
            check_data([log for log in trained if log["rank"] in [g[0] for g in groups]],
                       wines, epochs, rows_per_epoch)
            check_tp.check_group_outputs(trained, groups)
            if not check_tp.check_evaluation(yours, metrics, wines, groups):
                check_evaluation(yours, metrics, wines)
        else:  # "pipeline": the first stage reads the wines; each stage holds some layers
            firsts = [log for log in trained if any(len(step) for step in log["steps"])]
            check_data(check_pp.without_padding(firsts), wines, epochs, rows_per_epoch)
            check_pp.check_gradients(trained, module, wines, exercise)
            check_evaluation(yours, metrics, wines)
        compare(weights, metrics, reference, reference_metrics, trained, module, wines,
                steps_per_epoch, exercise)
        if exercise.layout == "tensor":  # two runs of the exercise's own
            check_tp.check_refusal(script, exercise, os.path.join(folder, "tp3"), timeout, run)
            check_tp.check_block(script, folder, timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exercise", help=f"the exercise: {', '.join(EXERCISES)}")
    parser.add_argument("script", help="your train.py (exercise 10b: your split_backward.py; "
                        "11: your ring_attention.py; 12: your experts.py; 13: your copy's "
                        "train.py)")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds each run may take before it is stopped")
    args = parser.parse_args(argv)
    if args.exercise not in EXERCISES:
        parser.error(f"no exercise {args.exercise!r}; the exercises are {', '.join(EXERCISES)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    exercise = EXERCISES[args.exercise]
    script = os.path.abspath(args.script)
    name = f"exercise {args.exercise} ({exercise.title})"
    try:
        if not os.path.isfile(script):
            raise Unchecked(f"there is no file {args.script}")
        check(exercise, script, args.timeout)
    except Unchecked as error:
        print(f"CANNOT CHECK {name}: {error}")
        return 2
    except Mistake as error:
        print(f"NOT YET {name}: {error.seen}")
        print(f"  most likely: {error.mistake}")
        print(f"  where to look: {error.where}")
        return 1
    print(f"PASS {name}: {exercise.passes.format(lesson=exercise.lesson)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
