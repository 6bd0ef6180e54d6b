"""Benchmark: what DDP buys on the hardware at hand, side by side with the alternatives.

Lesson 02's set-up (start_ranks, one process group, threads split between ranks, gloo on the CPU,
NCCL with one GPU per rank), used to measure instead of to train. For each world size 1..N it
trains two models for a fixed number of steps, warm-up excluded, and reports samples per second:
the lesson's 13->64->3 wine MLP (which will not speed up) and a torchvision ResNet-18 on random
images (which can). Beside them: the plain model without DDP (DDP's own cost at world size 1),
on the CPU one process using every core (the honest answer on a laptop), every rank with the
same few threads (how DDP scales when each rank brings its own cores) and, as its ceiling, as many
independent plain processes at once (what N workers reach with no communication at all); on GPUs
nn.DataParallel on the same 2..N GPUs; the DDP knobs that matter, and the all-reduce bandwidth of
the backend. Next to DDP, lesson 07's sharded strategies at every world size: ZeRO-1 (DDP with
ZeroRedundancyOptimizer) and FSDP2 (fully_shard), with the bytes of parameters, gradients and
optimizer state each rank holds, and on GPUs each rank's peak memory; and lesson 09's layouts of
the wine MLP: tensor parallelism (tp, fc1 column-wise and fc2 row-wise over all the ranks) and
2-D (dp x tp, FSDP over "dp" of TP groups of 2), whose TP ranks read the same batch. With
--pipeline, lesson 10's schedules (afab, gpipe, 1f1b, interleaved) on its deeper wine MLP, one
stage per rank: the bubble, measured with --simulate-ms (each layer sleeps, so a stage's compute
is known), and the samples/s with and without it, against one process running the same
micro-batches in turn.
On GPUs ResNet-18 runs as it is trained there: 224x224 images, batch 256 per GPU, bf16 autocast,
channels_last. Nothing is downloaded.

Every figure is the median of --repeats measurements (5; 3 with --quick), printed with its
spread (min-max). Starting a world size's processes costs seconds (each imports torch), so each
world size is one launch: its processes build and warm up every case once, run one untimed
round of them, then measure them in rounds, one repeat of every case per round (round robin), so
that a machine that slows down for a while slows every case alike instead of one case's repeats.
What is interleaved with what: the cases of one launch with each other; on the CPU the
per-worker cases of every world size (DDP and the independent processes, 1..N) all run in the
N-rank launch, ranks beyond a case's world size waiting, so that the per-worker efficiency
compares measurements taken side by side. Cases of different launches (the all-cores cases of
world size 1 against DDP on N ranks) are not interleaved. A noise check measures one case in the
last launch before its rounds and again after them: if the two medians differ by more than 5%,
the machine was too busy for the figures, and the run says so.

Run it:
    python benchmarks/scaling.py --quick                  # about 2 minutes on a 2-core laptop
    python benchmarks/scaling.py                          # the full default, minutes
    python benchmarks/scaling.py --models resnet18 --max-world-size 4
    python benchmarks/scaling.py --models wine-mlp --max-world-size 4   # tp on 2 and 4, 2d on 4
    python benchmarks/scaling.py --device cpu             # the CPU cases, even on a GPU node
    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/scaling.py # NCCL DDP and DataParallel, 1-2 GPUs
    python benchmarks/scaling.py --models resnet18 --knobs none --sharded none \
        --grad-sync after-backward,flat,overlap,buckets,ddp   # lesson 08's modes beside DDP
    python benchmarks/scaling.py --models wine-mlp --max-world-size 4 --knobs none \
        --sharded none --tensor-parallel none --pipeline afab,gpipe,1f1b,interleaved

It writes results.json and results.csv (one row per training case), allreduce.json and
allreduce.csv (one row per message size), pipeline.json and pipeline.csv (one row per pipeline
case), run.json (machine, command, load, noise check) and scaling.png into --out-dir.

This file is the run, from the flags to the report (main); its parts are in bench/, one file
per job: flags.py, plan.py (what is measured), cases.py (a case built on a rank), ranks.py (the
launches and their rounds), rows.py (medians, speed-ups, files), report.py (tables and plot).
"""


import json
import os
import sys
import time

import torch

from bench.flags import cpu_cores, parse_args
from bench.plan import plan_cases
from bench.ranks import run_world_size
from bench.report import plot, print_pipeline, print_tables, spread
from bench.rows import (
    BANDWIDTH_FIELDS,
    NOISE_LIMIT_PCT,
    PIPELINE_FIELDS,
    ROW_FIELDS,
    add_pipeline_speedups,
    add_speedups,
    cpu_name,
    load_average,
    noise_check,
    write_rows,
)


def main(args):
    """Plan the cases, run each world size's launch, then write, print and draw the results."""
    start, load_start, cores = time.time(), load_average(), cpu_cores()
    plan, backend, skipped = plan_cases(args, args.device_type, cores)
    total = sum(len(cases) for cases in plan.values())
    os.makedirs(args.out_dir, exist_ok=True)
    print_settings(args, cores, load_start)
    for reason in skipped:
        print(f"skipped: {reason}", flush=True)
    print(f"{total} cases over world sizes 1..{args.max_world_size} ({backend}), each the "
          f"median of {args.repeats} repeats, measured in rounds", flush=True)

    results = []
    for world_size, cases in plan.items():
        results += run_world_size(world_size, backend, cases, total, args)
    first, again = (next(r for r in results if r.get("noise_check") == when)
                    for when in ("start", "end"))
    results = [r for r in results if "noise_check" not in r]
    pipeline_rows = add_pipeline_speedups([r for r in results if "schedule" in r])
    rows = add_speedups([r for r in results if "samples_per_s" in r and "schedule" not in r])
    bandwidth_rows = [r for r in results if "algbw_GBps" in r]
    what = f"{first['model']} plain, world size 1, every core"
    difference, too_busy = noise_check(what, first["samples_per_s"], again["samples_per_s"],
                                       load_average())

    write_rows(rows, ROW_FIELDS, "results", args.out_dir)
    write_rows(bandwidth_rows, BANDWIDTH_FIELDS, "allreduce", args.out_dir)
    write_rows(pipeline_rows, PIPELINE_FIELDS, "pipeline", args.out_dir)
    plot(rows, bandwidth_rows, os.path.join(args.out_dir, "scaling.png"))
    noise = {"case": what, "limit_pct": NOISE_LIMIT_PCT, "difference_pct": difference,
             "too_busy": too_busy is not None, "message": too_busy,
             **{f"{when}_{field}": row[field] for when, row in (("start", first), ("end", again))
                for field in ("samples_per_s", "samples_per_s_min", "samples_per_s_max",
                              "processes", "repeat_order")}}
    run_info = write_run_info(args, cores, load_start, time.time() - start, noise)
    print_tables(rows, bandwidth_rows)
    print_pipeline(pipeline_rows)
    print(f"\nnoise check: {what} ran {first['samples_per_s']:.1f} samples/s ({spread(first)}) "
          f"before the last launch's rounds and {again['samples_per_s']:.1f} ({spread(again)}) "
          f"after them, "
          f"{difference:+.1f}%" + (f": within {NOISE_LIMIT_PCT:g}%, the machine held still"
                                   if too_busy is None else ""))
    if too_busy:
        print(too_busy)
    print(f"\ndone in {run_info['wall_seconds']:.0f} s; load average now "
          f"{run_info['load_average_end']} | results in {args.out_dir}", flush=True)


def print_settings(args, cores, load_start):
    """The machine, and what each model's cases will run: inputs, steps, precision."""
    gpus = torch.cuda.device_count()
    print(f"machine: {cpu_name()}, {cores} cores, {gpus} GPU(s); torch {torch.__version__}; "
          f"load average {load_start}", flush=True)
    if args.device_type == "cpu":
        reason = ("no CUDA GPU is visible (torch.cuda.device_count() == 0)" if gpus == 0
                  else "--device cpu was given")
        print(f"GPU cases (NCCL DDP, DataParallel, NCCL vs gloo on GPU tensors) skipped: "
              f"{reason}", flush=True)
    if args.quick:
        print("quick mode: fewer steps (and on the CPU smaller inputs), so the figures are "
              "rough; run without --quick for the full measurement", flush=True)
    if "resnet18" in args.models:
        layout = "channels_last" if args.channels_last else "contiguous (NCHW)"
        print(f"resnet18: random {args.image_size}x{args.image_size} images, batch "
              f"{args.batch_size} per rank, {args.steps} timed steps per repeat after "
              f"{args.warmup} warm-up steps, {args.precision}"
              f"{' autocast' if args.precision == 'bf16' else ''}, {layout}"
              f"{', cudnn.benchmark' if args.device_type == 'cuda' else ''}", flush=True)
        if args.precision_note:
            print(args.precision_note, flush=True)
        if args.channels_last and "fsdp" in args.sharded:
            print("resnet18 fsdp: contiguous (NCHW), as FSDP2 cannot shard channels_last "
                  "parameters", flush=True)
    if "wine-mlp" in args.models:
        print(f"wine-mlp: random 13-feature rows, batch {args.batch_size} per rank, "
              f"{args.mlp_steps} timed steps per repeat after {args.warmup} warm-up steps",
              flush=True)
        if args.tensor_parallel:
            print(f"wine-mlp {', '.join(args.tensor_parallel)}: lesson 09's layouts; the ranks "
                  f"of a TP group read the same batch, so its samples/s counts it once "
                  f"(global batch = batch per rank x dp)", flush=True)
    if args.pipeline:
        print(f"pipeline {', '.join(args.pipeline)}: lesson 10's schedules on its wine MLP with "
              f"--layers {args.pipeline_layers}, batch {args.batch_size} in "
              f"{args.microbatches} micro-batches, {args.bubble_steps} timed step(s) per repeat "
              f"with each layer sleeping {args.simulate_ms:g} ms forward and twice that "
              f"backward (the bubble), {args.pipeline_steps} without (samples/s)", flush=True)


def write_run_info(args, cores, load_start, wall_seconds, noise):
    """run.json: the machine, the command, the load, the noise check and every setting."""
    gpus = torch.cuda.device_count()
    run_info = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu_name(), "cores": cores,
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "torch": torch.__version__, "python": sys.version.split()[0],
        "load_average_start": load_start, "load_average_end": load_average(),
        "wall_seconds": wall_seconds, "noise_check": noise,
        "settings": {k: v for k, v in vars(args).items()},
    }
    with open(os.path.join(args.out_dir, "run.json"), "w") as f:
        json.dump(run_info, f, indent=2)
    return run_info


if __name__ == "__main__":
    main(parse_args())
