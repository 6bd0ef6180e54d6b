"""The results: each case's row (the median of its repeats, with their spread), the speed-ups
computed across rows, the files they are written to, and the noise check."""

import argparse
import csv
import functools
import json
import os
import statistics

from bench.cases import ALONE, PIPELINE_CASES, lesson10, tensor_layout
from bench.flags import SHARDED, TENSOR_PARALLEL

ROW_FIELDS = ("model", "case", "knob", "knob_value", "world_size", "processes", "backend",
              "device", "threads_per_rank", "batch_per_rank", "global_batch", "image_size",
              "precision", "channels_last", "accumulate", "steps", "warmup", "repeats",
              "seconds", "samples_per_s", "samples_per_s_min", "samples_per_s_max", "speedup",
              "efficiency", "efficiency_vs_ceiling", "vs_default", "ddp_cost_pct",
              "parameter_bytes", "gradient_bytes", "optimizer_bytes", "peak_bytes",
              "repeat_samples_per_s", "repeat_order")
BANDWIDTH_FIELDS = ("backend", "device", "world_size", "size_bytes", "iters", "repeats",
                    "seconds_per_op", "seconds_per_op_min", "seconds_per_op_max", "algbw_GBps",
                    "busbw_GBps", "repeat_order")
PIPELINE_FIELDS = ("model", "case", "schedule", "world_size", "stages", "chunks", "processes",
                   "backend", "device", "threads_per_rank", "layers", "microbatches",
                   "global_batch", "simulate_ms", "steps", "warmup", "repeats", "seconds",
                   "samples_per_s", "samples_per_s_min", "samples_per_s_max", "speedup",
                   "bubble_formula", "bubble", "bubble_min", "bubble_max", "ideal_speedup",
                   "repeat_samples_per_s", "repeat_bubble", "repeat_order")
# Two medians of the same case, at the start and at the end of a run, further apart than this:
# the machine's speed changed during the run, and its figures compare unlike conditions.
NOISE_LIMIT_PCT = 5.0


def summarise(case, seconds, order, held, processes):
    """The case's row: the median of its repeats, with their spread (min and max).

    algbw = bytes / time per all-reduce. busbw = algbw * 2(n-1)/n: a ring all-reduce sends and
    receives 2(n-1)/n of the message per rank, so busbw is what each link carried, comparable
    across world sizes and with the hardware's link speed. With n = 1 nothing crosses a link."""
    if case["case"] == "allreduce":
        per_op = [s / case["iters"] for s in seconds]
        median, n = statistics.median(per_op), case["world_size"]
        algbw = case["size_bytes"] / median / 1e9
        row = {field: case.get(field) for field in BANDWIDTH_FIELDS}
        row.update(repeats=len(per_op), seconds_per_op=median, seconds_per_op_min=min(per_op),
                   seconds_per_op_max=max(per_op), algbw_GBps=algbw,
                   busbw_GBps=algbw * 2 * (n - 1) / n if n > 1 else None, repeat_order=order)
        return row
    rates = [case["global_batch"] * case["steps"] / s for s in seconds]
    row = {field: case.get(field) for field in ROW_FIELDS}
    row.update(processes=processes, repeats=len(rates), seconds=statistics.median(seconds),
               samples_per_s=statistics.median(rates), samples_per_s_min=min(rates),
               samples_per_s_max=max(rates), repeat_samples_per_s=rates, repeat_order=order,
               **dict(zip(("parameter_bytes", "gradient_bytes", "optimizer_bytes", "peak_bytes"),
                          held, strict=True)))
    if case.get("noise_check"):
        row["noise_check"] = case["noise_check"]  # main() takes it out of the rows
    return row


def summarise_pipeline(case, seconds, order, bubbles, processes):
    """A pipeline case's row: samples/s and (with simulate_ms) the bubble, each the median of
    the repeats with their spread, and the bubble's formula for the case's p, v and m."""
    rates = [case["global_batch"] * case["steps"] / s for s in seconds]
    row = {field: case.get(field) for field in PIPELINE_FIELDS}
    row.update(processes=processes, repeats=len(rates), seconds=statistics.median(seconds),
               samples_per_s=statistics.median(rates), samples_per_s_min=min(rates),
               samples_per_s_max=max(rates), repeat_samples_per_s=rates, repeat_order=order,
               bubble_formula=bubble_formula(case["schedule"], case["stages"],
                                             case["microbatches"]))
    if bubbles:
        row.update(bubble=statistics.median(bubbles), bubble_min=min(bubbles),
                   bubble_max=max(bubbles), repeat_bubble=bubbles)
    return row


def bubble_formula(schedule, stages, microbatches):
    """The bubble of a schedule with no overheads, with F = B = W as the simulation sleeps them,
    by lesson 10's own predicted (its timeline.py): (p - 1) / (v*m + p - 1) for afab, GPipe,
    1F1B and interleaved (of the v*m + p - 1 slots a stage's work spreads over, p - 1 are idle);
    (p - 1) / (3m + p - 1) for zb1p, ZB-H1's idle (p - 1)(F + B - W) of m (F + B + W); 0 for zbv;
    None for dualpipev, for which no paper gives one."""
    settings = argparse.Namespace(schedule=schedule, stages=stages, microbatches=microbatches,
                                  simulate_ms=1.0, backward_ms=1.0, weight_ms=1.0)
    return timeline().predicted(settings)


@functools.cache
def timeline():
    """Lesson 10's timeline.py, imported once."""
    return lesson10("timeline")


def result_text(case, row):
    """The figure a case's line ends with: samples/s (and a pipeline's bubble), or bandwidth."""
    if case["case"] == "allreduce":
        return (f"busbw {row['busbw_GBps']:.3f} GB/s" if row["busbw_GBps"] is not None
                else f"algbw {row['algbw_GBps']:.3f} GB/s (busbw N/A with 1 rank)")
    result = (f"{row['samples_per_s']:.1f} samples/s "
              f"({row['samples_per_s_min']:.1f}-{row['samples_per_s_max']:.1f})")
    if case["case"] in PIPELINE_CASES and row["bubble"] is not None:
        formula = row["bubble_formula"]
        result += (f", bubble {row['bubble']:.3f} ({row['bubble_min']:.3f}-"
                   f"{row['bubble_max']:.3f}), formula "
                   f"{'none' if formula is None else format(formula, '.3f')}")
    return result


def case_name(case):
    """'ddp', a knob as 'static_graph=True', lesson 08's mode as 'lesson08 buckets', or lesson
    09's layout with its mesh as '2d (dp 2 x tp 2)'."""
    if case["case"] in TENSOR_PARALLEL:
        dp, tp = tensor_layout(case["case"], case["world_size"])
        return f"{case['case']} (dp {dp} x tp {tp})"
    if case["knob"] is None:
        return case["case"]
    if case["case"] == "lesson08":
        return f"lesson08 {case['knob_value']}"
    return f"{case['knob']}={case['knob_value']}"


def describe(case):
    if case["case"] in PIPELINE_CASES:
        simulated = (f"simulated {case['simulate_ms']:g} ms/layer" if case["simulate_ms"]
                     is not None else "not simulated")
        where = (f"{case['schedule']} p={case['stages']} x v={case['chunks']}"
                 if case["case"] == "pipeline" else "one process")
        return (f"{case['model']} --layers {case['layers']} pipeline {where}, "
                f"{case['microbatches']} micro-batches, {simulated} ws={case['world_size']} "
                f"({case['threads_per_rank']} thread(s)/rank, batch {case['global_batch']})")
    if case["case"] == "allreduce":
        return (f"all-reduce {case['backend']} on {case['device']} ws={case['world_size']} "
                f"{format_bytes(case['size_bytes'])}")
    name = case_name(case)
    if case.get("noise_check"):
        name += {"start": " (noise check, before the rounds)",
                 "end": " (noise check, after the rounds)"}[case["noise_check"]]
    return (f"{case['model']} {name} ws={case['world_size']} "
            f"({case['threads_per_rank']} thread(s)/rank, batch {case['batch_per_rank']}/rank)")


def format_bytes(size):
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def find_row(rows, model, case, world_size):
    """The row of this case at this world size with DDP's default settings (no knob)."""
    return next((r for r in rows if (r["model"], r["case"], r["world_size"]) ==
                 (model, case, world_size) and r["knob"] is None), None)


def add_speedups(rows):
    """Speed-up and efficiency against one rank, efficiency against the ceiling, vs_default, and
    DDP's own cost at 1 rank; all from the medians."""
    for row in rows:
        # ddp-per-worker, ceiling, zero1 and fsdp are compared with their own 1 rank; every
        # other case with DDP at 1 rank (on CPU, with every core).
        own = row["case"] in ("ddp-per-worker", "ceiling", *SHARDED)
        base = find_row(rows, row["model"], row["case"] if own else "ddp", 1)
        default = find_row(rows, row["model"], "ddp", row["world_size"])
        ceiling = find_row(rows, row["model"], "ceiling", row["world_size"])
        if base:
            row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
            # Ideal: N ranks (or GPUs) do N times the work of one, efficiency 1.0. A single
            # process has no N to divide by.
            if row["case"] not in ("plain", "single-process-all-cores"):
                row["efficiency"] = row["speedup"] / row["world_size"]
        # DDP (any knob), ZeRO-1, FSDP, TP or 2-D against N independent processes with the same
        # threads and batch per rank: 1.0 is all that this machine allows N workers, so what is
        # missing is what the communication costs. (A TP group of N that split each batch's
        # work evenly would reach it: each rank's share of a step, 1/N of the work, in 1/N of
        # the time.)
        if (ceiling and row["case"] not in (*ALONE, "dataparallel")
                and (row["threads_per_rank"], row["batch_per_rank"]) ==
                (ceiling["threads_per_rank"], ceiling["batch_per_rank"])):
            row["efficiency_vs_ceiling"] = row["samples_per_s"] / ceiling["samples_per_s"]
        # A knob, a sharded strategy or a TP layout, against DDP with default settings on as
        # many ranks. (tp and 2d have no 1-rank case of their own: their speed-up is against
        # DDP at 1 rank, the same model's step in one process.)
        if default and (row["knob"] is not None or row["case"] in (*SHARDED, *TENSOR_PARALLEL)):
            row["vs_default"] = row["samples_per_s"] / default["samples_per_s"]
        # What wrapping the model in DDP costs when there is nobody to talk to: DDP with 1 rank
        # against the plain model with the same threads, same loop, measured side by side
        # (every core: plain; per worker: the ceiling's one process).
        alone = {"ddp": "plain", "ddp-per-worker": "ceiling"}.get(row["case"])
        plain = alone and find_row(rows, row["model"], alone, 1)
        if plain and row is find_row(rows, row["model"], row["case"], 1):
            row["ddp_cost_pct"] = 100 * (1 - row["samples_per_s"] / plain["samples_per_s"])
    return rows


def add_pipeline_speedups(rows):
    """speedup = samples/s / that of one process with the same micro-batches, threads and
    simulation, measured in the same launch; ideal_speedup (simulated rows) = p x (1 - the
    bubble's formula): p stages that each sleep 1/p of the model's time, idle that share."""
    for row in rows:
        base = next((r for r in rows if r["case"] == "one-process" and
                     (r["processes"], r["simulate_ms"]) == (row["processes"], row["simulate_ms"])),
                    None)
        if base:
            row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        if row["simulate_ms"] is not None and row["bubble_formula"] is not None:
            row["ideal_speedup"] = row["stages"] * (1 - row["bubble_formula"])
    return rows


def write_rows(rows, fields, stem, out_dir):
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        # A list (each repeat's figure, in order) is one cell, its numbers separated by spaces.
        writer.writerows({k: " ".join(map(str, v)) if isinstance(v, list) else v
                          for k, v in row.items()} for row in rows)


def noise_check(what, start, end, load, limit_pct=NOISE_LIMIT_PCT):
    """Did the machine hold still? start and end: the medians, in samples/s, of the same case
    measured before the last launch's rounds and after them.

    Returns (difference in % of start, message): message is None when the two agree within
    limit_pct; otherwise one line saying that the machine was too busy for the run's figures,
    with its load average (os.getloadavg: processes running or waiting for a core, averaged
    over 1, 5 and 15 minutes) and what to do."""
    difference = 100 * (end - start) / start
    if abs(difference) <= limit_pct:
        return difference, None
    averages = "unknown" if load is None else ", ".join(f"{value:.2f}" for value in load)
    return difference, (
        f"too busy: the machine was too busy for these figures: {what} ran {start:.1f} "
        f"samples/s before the rounds and {end:.1f} after them, {difference:+.1f}% (more "
        f"than {limit_pct:g}%); load average {averages} (1, 5, 15 min). Stop what else runs "
        f"(top lists it), wait until the 1-minute load average is well below the number of "
        f"cores, and run again")


def load_average():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"
