"""benchmarks/scaling.py, run the way a workshop runs it: --quick, on an even tinier configuration.

The figures themselves depend on the machine; what is checked is that the run finishes, writes
every file, and that the rows have the documented schema and sensible values."""

import csv
import json
import os
import subprocess
import sys

import pytest

from helpers import GPUS, ROOT, assert_one_line_error

SCRIPT = ROOT / "benchmarks" / "scaling.py"
# Tiny: 32x32 images, batch 2, a couple of steps. Every case still runs, on 1 and 2 ranks.
TINY = ["--quick", "--image-size", 32, "--batch-size", 2, "--steps", 2, "--warmup", 1,
        "--mlp-steps", 10, "--allreduce-sizes", "4K,64K", "--allreduce-iters", 2]
ROW_TYPES = {"model": str, "case": str, "world_size": int, "backend": str, "device": str,
             "threads_per_rank": int, "batch_per_rank": int, "global_batch": int,
             "accumulate": int, "steps": int, "warmup": int, "seconds": float,
             "samples_per_s": float}
OPTIONAL_FLOATS = ("speedup", "efficiency", "vs_default")


def run_benchmark(*args, timeout=240):
    command = [sys.executable, str(SCRIPT), *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def read_rows(out_dir, stem):
    with open(out_dir / f"{stem}.json") as f:
        rows = json.load(f)
    with open(out_dir / f"{stem}.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    return rows, csv_rows


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("benchmarks")
    result = run_benchmark(*TINY, "--device", "cpu", "--max-world-size", 2, "--out-dir", out_dir)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result, out_dir


def test_quick_run_writes_every_file(cpu_run):
    _, out_dir = cpu_run
    for name in ("results.json", "results.csv", "allreduce.json", "allreduce.csv", "run.json",
                 "scaling.png"):
        assert (out_dir / name).stat().st_size > 0, f"{name} missing or empty"
    with open(out_dir / "scaling.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not list(out_dir.glob(".rows-*")), "a per-world-size scratch file was left behind"


def test_rows_have_the_schema(cpu_run):
    _, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")
    assert rows
    for row in rows:
        for field, kind in ROW_TYPES.items():
            assert isinstance(row[field], kind), (field, row)
        for field in OPTIONAL_FLOATS:
            assert row[field] is None or isinstance(row[field], float), (field, row)
        assert row["samples_per_s"] > 0, row
        assert (row["backend"], row["device"]) == ("gloo", "cpu")
    assert {row["model"] for row in rows} == {"wine-mlp", "resnet18"}
    for model in ("wine-mlp", "resnet18"):
        ddp = {r["world_size"] for r in rows if r["model"] == model and r["case"] == "ddp"
               and r["knob"] is None}
        assert ddp == {1, 2}, model
        cases = {r["case"] for r in rows if r["model"] == model}
        assert {"plain", "ddp", "single-process-all-cores"} <= cases, cases
        base = next(r for r in rows if r["model"] == model and r["case"] == "ddp"
                    and r["world_size"] == 1)
        assert base["speedup"] == pytest.approx(1.0) and base["efficiency"] == pytest.approx(1.0)


def test_threads_are_split_between_ranks(cpu_run):
    _, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for row in rows:
        if row["case"] == "ddp":
            assert row["threads_per_rank"] == max(1, cores // row["world_size"]), row
            assert row["global_batch"] == row["batch_per_rank"] * row["world_size"], row
        if row["case"] == "single-process-all-cores":
            assert (row["threads_per_rank"], row["global_batch"]) == (cores, 4), row


def test_every_knob_is_measured_on_resnet18_at_the_largest_world_size(cpu_run):
    _, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")
    knobs = {(r["knob"], r["knob_value"]) for r in rows if r["knob"] is not None}
    assert knobs == {("bucket_cap_mb", "1"), ("bucket_cap_mb", "100"),
                     ("gradient_as_bucket_view", "True"), ("static_graph", "True"),
                     ("fp16_hook", "True"), ("bf16_hook", "True"), ("no_sync", "4")}
    for row in (r for r in rows if r["knob"] is not None):
        assert (row["model"], row["world_size"]) == ("resnet18", 2), row
        assert row["vs_default"] > 0
        assert row["accumulate"] == (4 if row["knob"] == "no_sync" else 1)


def test_csv_has_the_same_rows_as_the_json(cpu_run):
    _, out_dir = cpu_run
    for stem in ("results", "allreduce"):
        rows, csv_rows = read_rows(out_dir, stem)
        assert len(csv_rows) == len(rows), stem
        for row, csv_row in zip(rows, csv_rows, strict=True):
            assert csv_row == {k: "" if v is None else str(v) for k, v in row.items()}, stem


def test_allreduce_bandwidth_follows_the_nccl_tests_definition(cpu_run):
    _, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "allreduce")
    assert {(r["world_size"], r["size_bytes"]) for r in rows} == {(2, 4096), (2, 65536)}
    for row in rows:
        assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / row["seconds_per_op"] / 1e9)
        # busbw = algbw * 2(n-1)/n, which is algbw itself with n = 2.
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])


def test_progress_and_table_are_printed(cpu_run):
    result, _ = cpu_run
    assert "[1/17] wine-mlp plain ws=1" in result.stdout, result.stdout
    assert "[17/17] all-reduce gloo on cpu ws=2 64 KiB" in result.stdout, result.stdout
    assert "GPU cases (NCCL DDP, DataParallel, NCCL vs gloo on GPU tensors) skipped" in \
        result.stdout
    assert "Training throughput" in result.stdout and "All-reduce bandwidth" in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--models", "alexnet"], "--models: unknown alexnet"),
    (["--knobs", "fast"], "--knobs: unknown fast"),
    (["--allreduce-sizes", "lots"], "--allreduce-sizes"),
    (["--max-world-size", 0], "--max-world-size must be at least 1"),
])
def test_bad_input_is_one_line_error(args, fragment, tmp_path):
    result = run_benchmark(*args, "--device", "cpu", "--out-dir", tmp_path, timeout=60)
    assert_one_line_error(result, fragment)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; none is visible on this machine")
def test_gpu_run_has_nccl_dataparallel_and_gloo_on_gpu_tensors(tmp_path):
    world = min(GPUS, 2)
    result = run_benchmark(*TINY, "--device", "cuda", "--max-world-size", world,
                           "--out-dir", tmp_path)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    rows, _ = read_rows(tmp_path, "results")
    assert {(r["backend"], r["device"]) for r in rows} == {("nccl", "cuda")}
    assert {r["world_size"] for r in rows if r["case"] == "dataparallel"} == \
        set(range(1, world + 1))
    assert all(r["samples_per_s"] > 0 for r in rows)
    bandwidth, _ = read_rows(tmp_path, "allreduce")
    assert {r["backend"] for r in bandwidth} == {"nccl", "gloo"}
