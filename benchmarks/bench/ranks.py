"""Running the cases: lesson 02's ranks, started once per world size, each building every case
of its launch and measuring them in rounds; the slowest rank's time is a repeat's."""

import datetime
import gc
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.cases import (
    ALONE,
    PIPELINE_CASES,
    build_allreduce_case,
    build_pipeline_case,
    build_training_case,
    largest_over_ranks,
    lesson08,
    lesson09,
    make_cublas_workspaces,
    pipeline_bubbles,
    tensor_layout,
)
from bench.flags import TENSOR_PARALLEL, fail
from bench.rows import describe, result_text, summarise, summarise_pipeline


def find_free_port():
    # Port 0 asks the operating system for any free port: one fresh port per world size, so a
    # group that is still closing cannot collide with the next one.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def setup_process_group(rank, world_size, backend, timeout):
    """Join the group of world_size processes; return this rank's device."""
    if backend == "nccl":
        # One GPU per rank, chosen before anything touches CUDA (see lesson 02).
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    # The timeout bounds every collective: a rank whose peer died fails after it instead of
    # waiting forever.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return device


def make_group(timeout, ranks=None, backend=None):
    """A process group beside the launch's, with its --timeout. Without one, new_group gives
    the backend's default, 30 minutes for gloo and 10 for NCCL, whatever init_process_group was
    given (torch 2.14, torch/distributed/distributed_c10d.py: _new_group_with_tag calls
    _get_default_timeout), and a collective that a peer never joins would hold the run that
    long. new_group's rule: every rank creates every
    group, in the same order."""
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout), backend=backend)


def leave_group(failed):
    """Leave the process group with the lessons' own guard_rails.leave_group: after a failure
    with NCCL it aborts the group, since destroying it would wait for collectives that no peer
    joins (its docstring says why); otherwise it destroys it."""
    lesson08().guard_rails.leave_group(failed)  # the guard_rails.py beside lesson 08's train.py


def slowest(seconds, device):
    """The largest of the ranks' times: a step is only done when the slowest rank is done."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def timed(work, device):
    """Seconds of the slowest rank for one repeat, the clock started on every rank at once.

    A rank that sits the case out passes a work() that does nothing: it waits at the barrier
    and in slowest()'s all-reduce, blocked in gloo or NCCL, not computing.
    Python's garbage collector is off while the clock runs, as timeit turns it off: a full
    collection walks every Python object of the process (about 120 ms here) and would land in
    whichever repeat crossed its threshold. It collects between repeats instead."""
    gc.disable()
    try:
        dist.barrier()
        start = time.perf_counter()
        work()
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    return slowest(seconds, device)


def worker(rank, world_size, backend, cases, total, args, partial_path, port):
    """What start_ranks runs in each rank: build every case of this launch, run one untimed
    round of them, then measure them in rounds, one repeat of every case per round (the noise
    check's case all at once before the rounds and after them). Rank 0 prints each case's
    result and writes the launch's rows to partial_path."""
    failed = True  # until the last line of the work: then the group is destroyed, not aborted
    # Where to meet, set here: a rank forked from the server has the environment the server
    # started with, at the first world size, not the launcher's of this one.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        device = setup_process_group(rank, world_size, backend, args.timeout)
        if device.type == "cuda":
            # Let cuDNN time its convolution algorithms for these shapes once and keep the
            # fastest, as GPU training scripts do. It tunes during the warm-up steps, and every
            # case of this process, plain model and DDP alike, runs with it.
            torch.backends.cudnn.benchmark = True
            make_cublas_workspaces(device)
        works, held, records = build_cases(rank, world_size, backend, cases, device, args.timeout)
        seconds, order = measure_in_rounds(cases, works, device, args.repeats, rank)
        # The bubbles of the simulated pipeline cases, from every stage's timeline.
        bubbles = {index: pipeline_bubbles(cases[index], record, args.repeats)
                   for index, record in records.items()
                   if cases[index]["simulate_ms"] is not None}
        rows = [summarise_pipeline(case, seconds[i], order[i], bubbles.get(i), world_size)
                if case["case"] in PIPELINE_CASES else
                summarise(case, seconds[i], order[i], held[i], world_size)
                for i, case in enumerate(cases)]
        if rank == 0:
            for case, row in zip(cases, rows, strict=True):
                print(f"[{case['index']}/{total}] {describe(case)} ... {result_text(case, row)}",
                      flush=True)
            with open(partial_path, "w") as f:
                json.dump(rows, f)
        failed = False
    finally:
        leave_group(failed)
    # As the lessons' leave_process: gloo's threads can abort a finished rank while Python tears
    # down the interpreter (torch 2.14; tools/repro_teardown.py, pytorch/pytorch#190489), so
    # flush and leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_groups(world_size, backend, cases, device, timeout):
    """The groups and meshes the cases need beyond the launch's group, made by every rank in
    the same order (new_group's rule): ({backend: group}, {world size: group}, {(dp, tp): mesh})."""
    # NCCL versus gloo on the same GPU tensors needs a second group.
    groups = {backend: None}
    if backend == "nccl" and any(case.get("backend") == "gloo" for case in cases):
        groups["gloo"] = make_group(timeout, backend="gloo")
    # A DDP case with fewer ranks than this launch (per worker, on the CPU) all-reduces in a
    # group of its own ranks.
    smaller = sorted({c["world_size"] for c in cases if c["world_size"] < world_size
                      and c["case"] not in (*ALONE, "dataparallel", *TENSOR_PARALLEL)})
    subgroups = {size: make_group(timeout, list(range(size))) for size in smaller}
    # A tp or 2d case runs on its dp x tp mesh, one per layout.
    meshes = {}
    for case in cases:
        if case["case"] in TENSOR_PARALLEL:
            layout = tensor_layout(case["case"], case["world_size"])
            if layout not in meshes:
                meshes[layout] = lesson09().build_mesh(device, timeout, dp=layout[0],
                                                       tp=layout[1])
    return groups, subgroups, meshes


def build_cases(rank, world_size, backend, cases, device, timeout):
    """Every case of the launch, built and warmed up on this rank: ([work], [held], {index:
    record}), work() one repeat of the case (nothing, on a rank outside it), held its memory
    figures (largest over the ranks), a pipeline case's record its timeline."""
    groups, subgroups, meshes = make_groups(world_size, backend, cases, device, timeout)
    works, held, records = [], [], {}
    for index, case in enumerate(cases):
        torch.set_num_threads(case["threads_per_rank"])
        if case["case"] in PIPELINE_CASES:
            # No memory figures, so no collective here for a rank outside the case.
            work, records[index] = (lambda: None), None
            if rank < case["world_size"]:
                work, records[index] = build_pipeline_case(
                    case, device, subgroups.get(case["world_size"]), rank)
            works.append(work)
            held.append(None)
            continue
        if rank >= case["world_size"]:
            work, mine = (lambda: None), [0, 0, 0, -1]  # not one of this case's ranks
        elif case["case"] == "allreduce":
            work, mine = build_allreduce_case(case, device, groups)
        elif case["case"] in TENSOR_PARALLEL:
            mesh = meshes[tensor_layout(case["case"], case["world_size"])]
            work, mine = build_training_case(case, device, mesh)
        else:
            work, mine = build_training_case(case, device, subgroups.get(case["world_size"]))
        works.append(work)
        held.append(None if mine is None else largest_over_ranks(mine, case, device))
    return works, held, records


def measure_in_rounds(cases, works, device, repeats, rank):
    """([seconds of each repeat], [its position in the run]) per case: one untimed round, the
    noise check's case before the rounds, `repeats` rounds of one repeat of every case, and the
    noise check's copy after them."""
    # What the builds left behind (every case's model, wrapper and optimizer: hundreds of
    # thousands of Python objects with torch's own) is collected now, outside any timing,
    # and frozen (gc.freeze): later collections skip it.
    gc.collect()
    gc.freeze()
    seconds, order = [[] for _ in cases], [[] for _ in cases]
    position, start = 0, time.monotonic()

    def run(index):
        torch.set_num_threads(cases[index]["threads_per_rank"])
        return timed(works[index], device)

    def measure(index):
        nonlocal position
        seconds[index].append(run(index))
        order[index].append(position)
        position += 1

    # One untimed round first, every case once: right after the builds, the first seconds of
    # measurement ran slow on a 2-core machine, whatever the case (benchmarks/README.md);
    # the round lets the processes settle.
    for index in range(len(cases)):
        run(index)
    checks = {when: [i for i, c in enumerate(cases) if c.get("noise_check") == when]
              for when in ("start", "end")}
    for index in checks["start"]:
        for _ in range(repeats):
            measure(index)
    # Round robin: one repeat of every case per round. Every case lives through all the
    # rounds (on a GPU: its input batch, weights, gradients and optimizer state; the
    # activations of a step are freed by its backward pass).
    for repeat in range(repeats):
        for index, case in enumerate(cases):
            if not case.get("noise_check"):
                measure(index)
        if rank == 0:
            print(f"world size {dist.get_world_size()}: round {repeat + 1}/{repeats} done, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
    for index in checks["end"]:
        for _ in range(repeats):
            measure(index)
    return seconds, order


def start_ranks(fn, args, nprocs, resnet):
    """Lesson 02's start_ranks, not joined: nprocs ranks forked from one server that imported
    this file (and with it torch) once, and kept for every world size of the run. Spawn
    where there is no fork (Windows) or it is not the default (macOS), as lesson 02 says."""
    if sys.platform != "linux":
        return mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    # __main__: scaling.py and the bench package it imports; DDP's constructor imports
    # torch._dynamo.
    mp.set_forkserver_preload(["__main__", "torch._dynamo"] + ["torchvision.models"] * resnet)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False,
                              start_method="forkserver")


def run_world_size(world_size, backend, cases, total, args):
    """Start world_size ranks for these cases; wait for them, bounded; return their rows."""
    partial_path = os.path.join(args.out_dir, f".rows-ws{world_size}.json")
    if os.path.exists(partial_path):
        os.remove(partial_path)
    print(f"world size {world_size}: starting {world_size} rank(s) ({backend}) for "
          f"{len(cases)} case(s), {args.repeats} round(s)", flush=True)
    context = start_ranks(worker, (world_size, backend, cases, total, args, partial_path,
                                   find_free_port()), world_size, resnet="resnet18" in args.models)
    # Every case's build and each of its repeats may take up to --timeout seconds; past that,
    # stop the ranks instead of hanging.
    deadline = time.monotonic() + args.timeout * (len(cases) * (args.repeats + 1) + 1)
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                fail(f"world size {world_size} took longer than {args.timeout} s per repeat; the "
                     "ranks were stopped. Is the machine busy? Try --quick or a larger --timeout")
    except mp.ProcessRaisedException as error:
        print(error, file=sys.stderr)
        if "OutOfMemoryError" in str(error):
            fail(f"rank {error.error_index} ran out of GPU memory at world size {world_size} "
                 "(traceback above); use a smaller --batch-size or --image-size")
        fail(f"rank {error.error_index} failed at world size {world_size} (its traceback is "
             "above); the other ranks were stopped")
    except mp.ProcessExitedException as error:
        # A negative exit code is the signal that ended the rank: SIGABRT (-6) is how NCCL's
        # watchdog ends a rank whose collective waited past --timeout, SIGKILL (-9) often the
        # out-of-memory killer.
        fail(f"rank {error.error_index} died with exit code {error.exit_code} at world size "
             f"{world_size} (-6: a collective waited longer than --timeout; -9: killed, often "
             "for lack of memory); the other ranks were stopped")
    with open(partial_path) as f:
        rows = json.load(f)
    os.remove(partial_path)
    return rows
