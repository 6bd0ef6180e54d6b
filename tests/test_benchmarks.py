"""benchmarks/scaling.py, run the way a workshop runs it: --quick, on an even tinier configuration.

The figures themselves depend on the machine; what is checked is that the run finishes, writes
every file, that the rows have the documented schema, that every figure is the median of repeats
measured in rounds (round robin), that every derived figure (speed-up, efficiency, efficiency
against the ceiling, DDP's cost at world size 1) is the documented formula of the measured ones,
and what the noise check says when two measurements disagree. Lesson 10's schedules run in the
same 2-rank launch, tiny: every schedule's row, its bubble beside the formula, its samples/s
and speed-up against one process. No figure is timed here. The GPU
settings, which no CPU run exercises, are checked on a pretend GPU: the defaults and the plan of
cases a run on 1 or 2 GPUs would measure, built without touching CUDA. How a rank leaves its
groups is checked too: a group beside the launch's waits no longer than its timeout, and after a
failure NCCL is aborted, not destroyed."""

import csv
import json
import os
import re
import statistics
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from bench.cases import AutocastForward, build_model, prepare, wrap_model
from bench.flags import default_settings, parse_args
from bench.plan import pipeline_problem, plan_cases
from bench.ranks import leave_group
from bench.rows import add_pipeline_speedups, case_name, noise_check, summarise, summarise_pipeline
from helpers import GPUS, ROOT, assert_one_line_error, fsdp_rows

BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "scaling.py"
# Tiny: 32x32 images, batch 2, one step per repeat, 2 repeats (the fewest that show the
# rounds). Every case still runs, on 1 and 2 ranks.
REPEATS = 2
TINY = ["--quick", "--image-size", 32, "--batch-size", 2, "--steps", 1, "--warmup", 1,
        "--mlp-steps", 10, "--allreduce-sizes", "4K,64K", "--allreduce-iters", 2,
        "--repeats", REPEATS]
# Five of lesson 10's schedules on 2 stages, tiny: 4 linear layers (interleaved and ZB-V: 4
# chunks of 1), batch 2 in 2 micro-batches, layers sleeping 2 ms (1 step per repeat), 2 steps
# without.
SCHEDULES = ("afab", "gpipe", "1f1b", "interleaved", "zbv")
PIPELINE_TINY = ["--pipeline", ",".join(SCHEDULES), "--pipeline-layers", 3, "--microbatches", 2,
                 "--simulate-ms", 2, "--pipeline-steps", 2, "--bubble-steps", 1]
ROW_TYPES = {"model": str, "case": str, "world_size": int, "processes": int, "backend": str,
             "device": str, "threads_per_rank": int, "batch_per_rank": int, "global_batch": int,
             "precision": str, "channels_last": bool, "accumulate": int, "steps": int,
             "warmup": int, "repeats": int, "seconds": float, "samples_per_s": float,
             "samples_per_s_min": float, "samples_per_s_max": float,
             "repeat_samples_per_s": list, "repeat_order": list}
OPTIONAL_FLOATS = ("speedup", "efficiency", "efficiency_vs_ceiling", "vs_default",
                   "ddp_cost_pct")
MEMORY = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


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
    result = run_benchmark(*TINY, *PIPELINE_TINY, "--device", "cpu", "--max-world-size", 2,
                           "--out-dir", out_dir)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result, out_dir


def test_quick_run_writes_every_file(cpu_run):
    _, out_dir = cpu_run
    for name in ("results.json", "results.csv", "allreduce.json", "allreduce.csv",
                 "pipeline.json", "pipeline.csv", "run.json", "scaling.png"):
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
        for field in MEMORY:
            assert isinstance(row[field], int) and row[field] > 0, (field, row)
        assert row["peak_bytes"] is None, row  # measured on GPUs only
        assert row["samples_per_s"] > 0, row
        assert (row["backend"], row["device"]) == ("gloo", "cpu")
        # The CPU keeps fp32 and the default memory format unless told otherwise.
        assert (row["precision"], row["channels_last"]) == ("fp32", False), row
        assert row["image_size"] == (32 if row["model"] == "resnet18" else None), row
    assert {row["model"] for row in rows} == {"wine-mlp", "resnet18"}
    for model in ("wine-mlp", "resnet18"):
        for case in ("ddp", "ddp-per-worker", "ceiling", "zero1", "fsdp"):
            sizes = {r["world_size"] for r in rows if r["model"] == model and r["case"] == case
                     and r["knob"] is None}
            assert sizes == {1, 2}, (model, case)
        cases = {r["case"] for r in rows if r["model"] == model}
        # Lesson 09's tp on the MLP only (at 2 ranks: 1 has nothing to split, and 2d needs 4).
        assert cases == {"plain", "ddp", "zero1", "fsdp", "single-process-all-cores",
                         "ddp-per-worker", "ceiling"} | ({"tp"} if model == "wine-mlp" else
                                                          set()), cases
        base = next(r for r in rows if r["model"] == model and r["case"] == "ddp"
                    and r["world_size"] == 1)
        assert base["speedup"] == pytest.approx(1.0) and base["efficiency"] == pytest.approx(1.0)
    assert [r["world_size"] for r in rows if r["case"] == "tp"] == [2]


def test_threads_are_split_between_ranks(cpu_run):
    _, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")
    for row in rows:
        if row["case"] in ("ddp", "zero1", "fsdp", "tp"):
            assert row["threads_per_rank"] == max(1, CORES // row["world_size"]), row
        if row["case"] in ("ddp", "zero1", "fsdp"):
            assert row["global_batch"] == row["batch_per_rank"] * row["world_size"], row
        if row["case"] == "tp":
            # The 2 ranks of the TP group read the same batch: it counts once (dp = 1).
            assert row["global_batch"] == row["batch_per_rank"] == 2, row
        if row["case"] == "single-process-all-cores":
            assert (row["threads_per_rank"], row["global_batch"]) == (CORES, 4), row
        if row["case"] in ("ddp-per-worker", "ceiling"):
            # 1 rank as well as 2 get the threads of one of 2 ranks: cores // 2, and all of them
            # are measured in the 2-rank launch, side by side.
            assert row["threads_per_rank"] == max(1, CORES // 2), row
            assert row["global_batch"] == row["batch_per_rank"] * row["world_size"], row
            assert row["processes"] == 2, row
        elif row["case"] != "dataparallel":
            assert row["processes"] == row["world_size"], row


def test_every_figure_is_the_median_of_repeats_measured_in_rounds(cpu_run):
    """Each row holds its repeats, in the order measured, and their median and spread; within
    a launch every case's repeat r comes before any case's repeat r + 1 (round robin), so a
    case's repeats are never measured back to back. Measuring one case's repeats in a row
    fails here."""
    _, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")
    bandwidth, _ = read_rows(out_dir, "allreduce")
    pipeline, _ = read_rows(out_dir, "pipeline")
    for row in rows + pipeline:
        each = row["repeat_samples_per_s"]
        assert row["repeats"] == len(each) == len(row["repeat_order"]) == REPEATS, row
        assert row["samples_per_s"] == pytest.approx(statistics.median(each)), row
        assert (row["samples_per_s_min"], row["samples_per_s_max"]) == (min(each), max(each))
        assert row["samples_per_s_min"] <= row["samples_per_s"] <= row["samples_per_s_max"]
        samples = row["global_batch"] * row["steps"]
        assert row["seconds"] == pytest.approx(statistics.median(samples / x for x in each))
    for row in bandwidth:
        assert row["repeats"] == len(row["repeat_order"]) == REPEATS, row
        assert row["seconds_per_op_min"] <= row["seconds_per_op"] <= row["seconds_per_op_max"]
    launches = {}
    for row in rows + bandwidth + pipeline:
        launches.setdefault(row.get("processes", row["world_size"]), []).append(row["repeat_order"])
    assert set(launches) == {1, 2}
    for orders in launches.values():
        positions = [p for order in orders for p in order]
        assert len(set(positions)) == len(positions), "two measurements at one position"
        for repeat in range(REPEATS - 1):
            assert max(o[repeat] for o in orders) < min(o[repeat + 1] for o in orders), orders


def test_derived_figures_are_their_formulas(cpu_run):
    """speed-up, efficiency and DDP's cost at world size 1 from the rows' own samples/s."""
    result, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")

    def find(model, case, world_size):
        return next(r for r in rows if (r["model"], r["case"], r["world_size"]) ==
                    (model, case, world_size) and r["knob"] is None)

    for model in ("wine-mlp", "resnet18"):
        plain, ddp1 = find(model, "plain", 1), find(model, "ddp", 1)
        cost = 100 * (1 - ddp1["samples_per_s"] / plain["samples_per_s"])
        assert ddp1["ddp_cost_pct"] == pytest.approx(cost), ddp1
        printed = re.search(rf"{model}: every core, DDP at world size 1 .* own cost is "
                            rf"(-?[\d.]+)%", result.stdout)
        assert printed and float(printed[1]) == pytest.approx(cost, abs=0.051), result.stdout
        for case in ("ddp", "ddp-per-worker", "ceiling", "zero1", "fsdp"):
            one, two = find(model, case, 1), find(model, case, 2)
            # Efficiency = samples/s of N ranks / (N x samples/s of 1 rank of the same case).
            assert two["efficiency"] == pytest.approx(
                two["samples_per_s"] / (2 * one["samples_per_s"])), two
            assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
        per_worker, ceiling = find(model, "ddp-per-worker", 2), find(model, "ceiling", 2)
        assert f"DDP's efficiency {per_worker['efficiency']:.0%}" in result.stdout
        # Against the ceiling: 2 independent processes with the same threads and batch.
        assert per_worker["efficiency_vs_ceiling"] == pytest.approx(
            per_worker["samples_per_s"] / ceiling["samples_per_s"]), per_worker
        assert f"against this ceiling is {per_worker['efficiency_vs_ceiling']:.0%}" in \
            result.stdout
        for row in (r for r in rows if r["model"] == model):
            has_ceiling = row["case"] in ("ddp", "ddp-per-worker", "zero1", "fsdp", "tp") and \
                row["threads_per_rank"] == ceiling["threads_per_rank"]
            assert (row["efficiency_vs_ceiling"] is not None) == has_ceiling, row
        alone = find(model, "ceiling", 1)
        per_worker_cost = 100 * (1 - find(model, "ddp-per-worker", 1)["samples_per_s"] /
                                 alone["samples_per_s"])
        assert find(model, "ddp-per-worker", 1)["ddp_cost_pct"] == pytest.approx(per_worker_cost)
        # A sharded strategy against DDP on as many ranks: what sharding costs in samples/s.
        for case in ("zero1", "fsdp"):
            for world_size in (1, 2):
                row = find(model, case, world_size)
                assert row["vs_default"] == pytest.approx(
                    row["samples_per_s"] / find(model, "ddp", world_size)["samples_per_s"]), row
    # TP has no 1-rank case: its speed-up is against DDP at 1 rank, as DDP's own.
    tp, ddp1 = find("wine-mlp", "tp", 2), find("wine-mlp", "ddp", 1)
    assert tp["speedup"] == pytest.approx(tp["samples_per_s"] / ddp1["samples_per_s"]), tp
    assert tp["efficiency"] == pytest.approx(tp["speedup"] / 2), tp
    assert tp["vs_default"] == pytest.approx(
        tp["samples_per_s"] / find("wine-mlp", "ddp", 2)["samples_per_s"]), tp
    assert tp["efficiency_vs_ceiling"] == pytest.approx(
        tp["samples_per_s"] / find("wine-mlp", "ceiling", 2)["samples_per_s"]), tp
    only = [(r["model"], r["case"], r["world_size"]) for r in rows
            if r["ddp_cost_pct"] is not None]
    assert sorted(only) == sorted((model, case, 1) for model in ("wine-mlp", "resnet18")
                                  for case in ("ddp", "ddp-per-worker")), only


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


def fsdp_rank0_bytes(tensors, world_size):
    """Bytes of parameters (and so of gradients, and of SGD's momentum) on FSDP's most loaded
    rank: each tensor cut along dim 0 into chunks of ceil(rows / N) rows, rank 0's a full one."""
    return sum(fsdp_rows(p.shape[0], 0, world_size) * p[0].numel() * p.element_size()
               for p in tensors)


def tensor_parallel_bytes(dp, tp, dp_rank=0):
    """Bytes of the wine MLP's parameters on one rank of lesson 09's dp x tp layout: fc1
    column-wise (64/tp of its rows and of its bias), fc2 row-wise (64/tp of its columns, its bias
    whole), then FSDP over dp cutting each piece along dim 0 (fsdp_rows)."""
    shapes = [(64 // tp, 13), (64 // tp, 1), (3, 64 // tp), (3, 1)]  # (rows, elements per row)
    return sum(4 * fsdp_rows(rows, dp_rank, dp) * per_row for rows, per_row in shapes)


def test_memory_per_rank_is_each_strategys_share(cpu_run):
    """DDP holds everything; ZeRO-1 holds 1/N of the optimizer state (up to one whole tensor,
    as it deals whole tensors); FSDP holds 1/N of all three (up to one row per tensor). With one
    rank all three hold what DDP holds. A strategy that shards nothing fails here."""
    result, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")
    for model in ("wine-mlp", "resnet18"):
        def held(case, world_size, rows=rows, model=model):
            row = next(r for r in rows if (r["model"], r["case"], r["world_size"]) ==
                       (model, case, world_size) and r["knob"] is None)
            return [row[field] for field in MEMORY]

        tensors = list(build_model(model).parameters())
        whole = sum(p.numel() * p.element_size() for p in tensors)
        assert held("ddp", 1) == held("ddp", 2) == [whole] * 3
        assert held("zero1", 1) == held("fsdp", 1) == [whole] * 3
        assert held("fsdp", 2) == [fsdp_rank0_bytes(tensors, 2)] * 3
        assert held("fsdp", 2)[0] < 0.55 * whole
        params, grads, optimizer = held("zero1", 2)
        largest = max(p.numel() * p.element_size() for p in tensors)
        assert (params, grads) == (whole, whole)
        assert whole / 2 <= optimizer <= whole / 2 + largest
        assert optimizer < whole
    assert "fsdp on 2 ranks holds 50% of DDP's" in result.stdout, result.stdout
    # TP on 2 ranks: 416 + 32 of fc1, 96 + 3 of fc2 = 547 parameters, 2,188 bytes, and as many
    # of gradients and of momentum (DTensors: each rank's local slices, to_local()).
    row = next(r for r in rows if r["case"] == "tp")
    assert tensor_parallel_bytes(1, 2) == 547 * 4 == 2188
    assert [row[field] for field in MEMORY] == [2188] * 3, row
    assert "tp on 2 ranks holds 50% of DDP's" in result.stdout, result.stdout


# Lesson 09's layouts on 4 ranks (tp 4, and 2d: dp 2 x tp 2), without a whole run's 1..4 launches
# (over a minute here): four gloo ranks forked from one process that imported the benchmark once.
# First they build the tp and 2d cases with build_training_case (one warm-up step), recording the
# batch each rank read and the model it trained, and rank 0 prints every rank's batch, the bytes
# each rank holds, and how far the trained model's parameters (gathered whole) are from one
# process's step on the dp rows' batches. Then, in a process group of their own, they run the
# benchmark's own worker() on the 4-rank launch's tp, 2d and ddp cases, and the parent prints
# its rows.
FOUR_RANKS = """
import json, multiprocessing, os, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, sys.argv[1])  # benchmarks/, where scaling.py finds its bench package
from bench import cases
from bench.flags import cpu_cores, parse_args
from bench.plan import pipeline_problem, plan_cases
from bench.ranks import find_free_port, setup_process_group, worker
from bench.rows import add_speedups

out_dir = sys.argv[2]
args = parse_args([*sys.argv[3:], "--device", "cpu", "--max-world-size", "4",
                   "--models", "wine-mlp", "--knobs", "none", "--sharded", "none",
                   "--out-dir", out_dir])
plan, _, _ = plan_cases(args, "cpu", cpu_cores())
launch = [c for c in plan[4] if c["case"] in ("ddp", "tp", "2d") and c["world_size"] == 4]
for index, case in enumerate(launch, 1):
    case["index"] = index
partial = os.path.join(out_dir, "rows.json")


def check(rank):
    device = setup_process_group(rank, 4, "gloo", 60)
    seen, trained = [], []
    make_batch, build_optimizer = cases.make_batch, cases.build_optimizer
    cases.make_batch = lambda *a, **k: seen.append(make_batch(*a, **k)) or seen[-1]
    cases.build_optimizer = lambda model, case: trained.append(model) or build_optimizer(
        model, case)
    report = {}
    for case in (c for c in launch if c["case"] in ("tp", "2d")):
        dp, tp = cases.tensor_layout(case["case"], 4)
        mesh = cases.lesson09().build_mesh(device, 60, dp=dp, tp=tp)
        _, held = cases.build_training_case({**case, "warmup": 1}, device, mesh)
        whole = [p.full_tensor() for p in trained[-1].parameters()]
        batches, helds = [None] * 4, [None] * 4
        dist.all_gather_object(batches, [t.tolist() for t in seen[-1]])
        dist.all_gather_object(helds, held)
        if rank == 0:
            # One process, one step on the dp rows' batches: FSDP averages the dp rows'
            # gradients, and each row's loss is the mean over its batch of the same size.
            plain = cases.build_model("wine-mlp")
            optimizer = build_optimizer(plain, {"case": "ddp"})
            rows = [batches[d * tp] for d in range(dp)]
            features = torch.tensor([x for row in rows for x in row[0]])
            labels = torch.tensor([y for row in rows for y in row[1]])
            F.cross_entropy(plain(features), labels).backward()
            optimizer.step()
            report[case["case"]] = {
                "batches": batches, "held": helds,
                "difference": max((a - b).abs().max().item()
                                  for a, b in zip(whole, plain.parameters(), strict=True))}
    if rank == 0:
        print("CHECK " + json.dumps(report), flush=True)
    cases.make_batch, cases.build_optimizer = make_batch, build_optimizer
    dist.barrier()
    dist.destroy_process_group()


def rank(r, ports):
    os.environ["MASTER_PORT"] = ports[0]
    check(r)
    worker(r, 4, "gloo", launch, len(launch), args, partial, ports[1])  # os._exit(0)


os.environ["MASTER_ADDR"] = "127.0.0.1"
ports = [str(find_free_port()) for _ in range(2)]
ranks = [multiprocessing.get_context("fork").Process(target=rank, args=(r, ports))
         for r in range(4)]
for process in ranks:
    process.start()
for process in ranks:
    process.join(180)
print("exit codes", [process.exitcode for process in ranks], flush=True)
with open(partial) as f:
    print("ROWS " + json.dumps(add_speedups(json.load(f))), flush=True)
"""


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """{"rows": the 4-rank launch's rows, "check": the batches, bytes and difference above}."""
    out_dir = tmp_path_factory.mktemp("four_ranks")
    # TINY, with 4 MLP steps per repeat instead of 10: the figures are not what is checked.
    result = subprocess.run([sys.executable, "-c", FOUR_RANKS, str(BENCHMARKS), str(out_dir),
                             *map(str, [*TINY, "--mlp-steps", 4, "--timeout", 60])],
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert "exit codes [0, 0, 0, 0]" in result.stdout, output
    found = {key: json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
             for key in ("ROWS", "CHECK") if line.startswith(key + " ")}
    assert set(found) == {"ROWS", "CHECK"}, output
    return {"rows": found["ROWS"], "check": found["CHECK"]}


def test_tensor_parallel_rows_on_four_ranks(four_ranks):
    """tp 4 (dp 1 x tp 4) and 2d (dp 2 x tp 2) beside DDP on the same 4 ranks: the group's
    batch counted once (global batch = batch per rank x dp), the median of the repeats with its
    spread, and the bytes the most loaded rank holds: tp 4 holds 275 parameters (1,100 bytes),
    2d's dp rank 0 290 (1,160; fc2's 3 rows split 2 and 1 by FSDP)."""
    rows = {row["case"]: row for row in four_ranks["rows"]}
    assert set(rows) == {"ddp", "tp", "2d"}
    for case, dp, held in (("tp", 1, 1100), ("2d", 2, 1160)):
        row = rows[case]
        for field, kind in ROW_TYPES.items():
            assert isinstance(row[field], kind), (field, row)
        assert (row["model"], row["world_size"], row["processes"], row["knob"]) == \
            ("wine-mlp", 4, 4, None), row
        assert row["threads_per_rank"] == rows["ddp"]["threads_per_rank"], row
        assert row["global_batch"] == row["batch_per_rank"] * dp == 2 * dp, row
        assert row["repeats"] == len(row["repeat_samples_per_s"]) == REPEATS, row
        assert row["samples_per_s"] == pytest.approx(
            statistics.median(row["repeat_samples_per_s"])), row
        assert row["samples_per_s_min"] <= row["samples_per_s"] <= row["samples_per_s_max"]
        samples = row["global_batch"] * row["steps"]
        assert row["seconds"] == pytest.approx(
            statistics.median(samples / x for x in row["repeat_samples_per_s"])), row
        assert [row[field] for field in MEMORY] == [held] * 3, row
        assert row["vs_default"] == pytest.approx(
            row["samples_per_s"] / rows["ddp"]["samples_per_s"]), row
    assert tensor_parallel_bytes(1, 4) == 1100
    assert tensor_parallel_bytes(2, 2, 0) == 1160 and tensor_parallel_bytes(2, 2, 1) == 1028


def test_tensor_parallel_ranks_read_one_batch_and_train_one_model(four_ranks):
    """The ranks of a TP group read the same batch, the dp rows different ones, and one step of
    the split model is one process's step on the dp rows' batches: a TP group whose ranks read
    different batches, or a layer split the wrong way, fails here. Every rank's bytes: 2d's dp
    rank 1 (ranks 2 and 3) holds fc2's one short row, 257 parameters (1,028 bytes)."""
    check = four_ranks["check"]
    assert set(check) == {"tp", "2d"}
    tp, two_d = check["tp"], check["2d"]
    assert all(batch == tp["batches"][0] for batch in tp["batches"]), tp["batches"]
    assert two_d["batches"][0] == two_d["batches"][1] != two_d["batches"][2] == \
        two_d["batches"][3], two_d["batches"]
    for report in (tp, two_d):
        assert report["difference"] < 1e-6, report["difference"]
    assert [held[:3] for held in tp["held"]] == [[1100] * 3] * 4
    assert [held[:3] for held in two_d["held"]] == \
        [[1160] * 3, [1160] * 3, [1028] * 3, [1028] * 3]


def test_fsdp_refuses_channels_last_which_its_rows_avoid():
    """The PyTorch behaviour the fsdp rows work around (tools/repro_fsdp_channels_last.py): on
    this torch, fully_shard refuses channels_last weights. The day it stops refusing, this
    fails, and the fsdp rows can run channels_last like the others."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "repro_fsdp_channels_last.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "channels_last Conv2d weight: refused" in result.stdout, result.stdout
    assert "non-contiguous" in result.stdout, result.stdout


def test_csv_has_the_same_rows_as_the_json(cpu_run):
    _, out_dir = cpu_run
    for stem in ("results", "allreduce", "pipeline"):
        rows, csv_rows = read_rows(out_dir, stem)
        assert rows, stem
        assert len(csv_rows) == len(rows), stem
        for row, csv_row in zip(rows, csv_rows, strict=True):
            # A list (each repeat's figure) is one cell, its numbers separated by spaces.
            assert csv_row == {k: "" if v is None else " ".join(map(str, v))
                               if isinstance(v, list) else str(v) for k, v in row.items()}, stem


def test_allreduce_bandwidth_follows_the_nccl_tests_definition(cpu_run):
    _, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "allreduce")
    assert {(r["world_size"], r["size_bytes"]) for r in rows} == {(2, 4096), (2, 65536)}
    for row in rows:
        # From the median time per all-reduce.
        assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / row["seconds_per_op"] / 1e9)
        # busbw = algbw * 2(n-1)/n, which is algbw itself with n = 2 (other n: the test below).
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])


@pytest.mark.parametrize("world_size, factor", [(1, None), (2, 1), (3, 4 / 3), (4, 3 / 2)],
                         ids=["1-rank", "2-ranks", "3-ranks", "4-ranks"])
def test_bus_bandwidth_is_algbw_times_2_n_minus_1_over_n(world_size, factor):
    # The function that makes each all-reduce row, given repeats of 4 all-reduces of 1 MB each:
    # at 3 and 4 ranks, where a factor of 1 (what the run above can show) would be wrong.
    case = {"case": "allreduce", "world_size": world_size, "size_bytes": 10**6, "iters": 4}
    row = summarise(case, [0.008, 0.004, 0.012], [0, 1, 2], held=None,
                                    processes=world_size)
    assert row["seconds_per_op"] == pytest.approx(0.002)  # the median repeat, per all-reduce
    assert row["algbw_GBps"] == pytest.approx(0.5)  # 1 MB in 2 ms
    assert row["busbw_GBps"] == (None if factor is None else pytest.approx(0.5 * factor))


def test_progress_and_table_are_printed(cpu_run):
    result, _ = cpu_run
    assert "[1/48] wine-mlp plain ws=1" in result.stdout, result.stdout
    assert "[3/48] wine-mlp zero1 ws=1" in result.stdout, result.stdout
    assert "[11/48] resnet18 plain (noise check, before the rounds) ws=1" in result.stdout
    assert "[15/48] wine-mlp tp (dp 1 x tp 2) ws=2" in result.stdout, result.stdout
    assert "[35/48] all-reduce gloo on cpu ws=2 64 KiB" in result.stdout, result.stdout
    assert ("[36/48] wine-mlp --layers 3 pipeline one process, 2 micro-batches, simulated 2 "
            "ms/layer ws=1") in result.stdout, result.stdout
    assert ("[40/48] wine-mlp --layers 3 pipeline interleaved p=2 x v=2, 2 micro-batches, "
            "simulated 2 ms/layer ws=2") in result.stdout, result.stdout
    assert "[48/48] resnet18 plain (noise check, after the rounds) ws=1" in result.stdout
    # What lesson 09's layouts leave out, and why, the way other skipped cases are reported.
    for line in ("skipped: resnet18 tp, 2d: lesson 09's plan splits Linear layers",
                 "skipped: wine-mlp tp at world size(s) 1: one TP group of every rank needs 2",
                 "skipped: wine-mlp 2d at world size(s) 1, 2: dp x tp with tp = 2 needs an even "
                 "world size of 4 or more; use --max-world-size 4"):
        assert line in result.stdout, result.stdout
    assert f"world size 2: round {REPEATS}/{REPEATS} done" in result.stdout, result.stdout
    assert "GPU cases (NCCL DDP, DataParallel, NCCL vs gloo on GPU tensors) skipped" in \
        result.stdout
    for title in ("Training throughput", "Memory per rank, MiB", "All-reduce bandwidth",
                  "Pipeline (lesson 10)"):
        assert title in result.stdout, result.stdout


def test_noise_check_measures_one_case_before_and_after_the_rounds(cpu_run):
    """run.json records both medians of the plain model at world size 1, measured in the last
    launch (the other rank waiting): every repeat of the first before the rounds, every repeat
    of the second after them; neither is a results row."""
    result, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "results")
    bandwidth, _ = read_rows(out_dir, "allreduce")
    with open(out_dir / "run.json") as f:
        check = json.load(f)["noise_check"]
    assert check["case"] == "resnet18 plain, world size 1, every core"
    assert (check["start_processes"], check["end_processes"]) == (2, 2)
    rounds = [p for r in rows + bandwidth if r.get("processes", r["world_size"]) == 2
              for p in r["repeat_order"]]
    assert len(check["start_repeat_order"]) == len(check["end_repeat_order"]) == REPEATS
    assert max(check["start_repeat_order"]) < min(rounds)
    assert max(rounds) < min(check["end_repeat_order"])
    assert check["difference_pct"] == pytest.approx(
        100 * (check["end_samples_per_s"] / check["start_samples_per_s"] - 1))
    assert check["limit_pct"] == 5
    assert check["too_busy"] == (abs(check["difference_pct"]) > 5)
    assert (check["message"] is not None) == check["too_busy"]
    assert f"noise check: {check['case']} ran {check['start_samples_per_s']:.1f}" in \
        result.stdout, result.stdout
    assert len([r for r in rows if r["case"] == "plain" and r["model"] == "resnet18"]) == 1


def test_noise_check_says_when_the_machine_is_too_busy():
    """Within 5% there is nothing to say; beyond it, in either direction, one line that names
    the case, both figures, the load average and what to do."""
    what = "resnet18 plain, world size 1, every core"
    difference, message = noise_check(what, 60.0, 57.3, [0.4, 0.3, 0.2])
    assert difference == pytest.approx(-4.5) and message is None
    for end in (56.9, 63.1):
        difference, message = noise_check(what, 60.0, end, [3.25, 2.5, 1.0])
        assert abs(difference) > 5 and "\n" not in message, message
        for fragment in ("too busy for these figures", what, "60.0 samples/s", f"{end:.1f}",
                         f"{difference:+.1f}%", "load average 3.25, 2.50, 1.00", "run again"):
            assert fragment in message, (fragment, message)
    assert "load average unknown" in noise_check(what, 60.0, 50.0, None)[1]


def test_pipeline_rows_give_every_schedules_bubble_beside_its_formula(cpu_run):
    """Five of lesson 10's schedules on 2 stages, each simulated (the bubble) and not, beside one
    process running the same micro-batches in turn: the formula column is (p - 1) / (v*m + p -
    1) for each row's p, v and m (ZB-V's 0), the bubble the median of its repeats' (each within
    [0, 1)), samples/s and the speed-up against the one process of the same launch and
    simulation."""
    result, out_dir = cpu_run
    rows, _ = read_rows(out_dir, "pipeline")
    found = {(r["case"], r["schedule"], r["stages"], r["chunks"], r["simulate_ms"]) for r in rows}
    assert found == {(case, schedule, stages, 2 if schedule in ("interleaved", "zbv") else 1, ms)
                     for ms in (2.0, None)
                     for case, schedule, stages in [("one-process", "afab", 1)] +
                     [("pipeline", s, 2) for s in SCHEDULES]}, found
    assert len(rows) == len(found) == 12
    base = {ms: next(r for r in rows if r["case"] == "one-process" and r["simulate_ms"] == ms)
            for ms in (2.0, None)}
    for row in rows:
        p, v, m = row["stages"], row["chunks"], row["microbatches"]
        assert (row["model"], row["layers"], m, row["global_batch"]) == ("wine-mlp", 3, 2, 2), row
        assert row["world_size"] == p and row["processes"] == 2, row
        assert row["threads_per_rank"] == max(1, CORES // 2), row
        assert row["bubble_formula"] == pytest.approx(  # ZB-V's: none at F = B = W
            0 if row["schedule"] == "zbv" else (p - 1) / (v * m + p - 1)), row
        assert row["repeats"] == REPEATS and row["samples_per_s"] > 0, row
        assert row["speedup"] == pytest.approx(
            row["samples_per_s"] / base[row["simulate_ms"]]["samples_per_s"]), row
        if row["simulate_ms"] is None:
            assert row["steps"] == 2, row
            assert row["bubble"] is row["repeat_bubble"] is row["ideal_speedup"] is None, row
            continue
        each = row["repeat_bubble"]
        assert row["steps"] == 1 and len(each) == REPEATS, row
        assert row["bubble"] == pytest.approx(statistics.median(each)), row
        assert (row["bubble_min"], row["bubble_max"]) == (min(each), max(each)), row
        assert 0 <= row["bubble_min"] <= row["bubble"] <= row["bubble_max"] < 1, row
        assert row["ideal_speedup"] == pytest.approx(p * (1 - row["bubble_formula"])), row
    formulas = {(r["schedule"], r["stages"]): r["bubble_formula"] for r in rows}
    assert formulas == {("afab", 1): 0, ("afab", 2): pytest.approx(1 / 3),
                        ("gpipe", 2): pytest.approx(1 / 3), ("1f1b", 2): pytest.approx(1 / 3),
                        ("interleaved", 2): pytest.approx(1 / 5), ("zbv", 2): 0}
    interleaved = next(r for r in rows if r["schedule"] == "interleaved" and r["simulate_ms"])
    assert re.search(rf"\ninterleaved +2x2 +0\.200 +{interleaved['bubble']:.3f} ", result.stdout), \
        result.stdout


def test_pipeline_cases_are_planned_where_the_layers_split():
    """--pipeline: each schedule at every world size of 2 or more where lesson 10 can run it,
    in that world size's launch, beside one process (1 rank, the others waiting), simulated
    and not; the rest listed as skipped with the reason. None by default, so that the default
    run's time does not grow."""
    args = parse_args(["--device", "cpu", "--max-world-size", "4", "--pipeline",
                       ",".join(SCHEDULES), "--knobs", "none"])
    assert (args.pipeline_layers, args.microbatches, args.simulate_ms) == (7, 8, 10)
    plan, _, skipped = plan_cases(args, "cpu", CORES)
    for launch in (1, 2, 3, 4):
        cases = [c for c in plan[launch] if c["case"] in ("pipeline", "one-process")]
        expected = [] if launch in (1, 3) else [
            (case, schedule, stages, ms) for ms in (10, None)
            for case, schedule, stages in [("one-process", "afab", 1)] +
            [("pipeline", s, launch) for s in SCHEDULES]]
        assert [(c["case"], c["schedule"], c["world_size"], c["simulate_ms"]) for c in cases] \
            == expected, launch
        assert all(c["threads_per_rank"] == max(1, CORES // launch) for c in cases)
    # 8 linear layers do not split into 3 stages, nor into 6 (3 ranks x 2 chunks).
    assert [line for line in skipped if line.startswith("pipeline")] == [
        "pipeline afab, gpipe, 1f1b at world size 3: 8 linear layers (--pipeline-layers 7) do "
        "not split evenly into 3 stages", "pipeline interleaved, zbv at world size 3: 8 linear "
        "layers (--pipeline-layers 7) do not split evenly into 6 stages"]
    args = parse_args(["--device", "cpu", "--max-world-size", "4", "--pipeline",
                       ",".join(SCHEDULES), "--pipeline-layers", "3",
                       "--microbatches", "2"])
    plan, _, skipped = plan_cases(args, "cpu", CORES)
    assert {c["schedule"] for c in plan[4] if c["case"] == "pipeline"} == {"afab", "gpipe"}
    assert [line for line in skipped if "at world size 4" in line] == [
        "pipeline 1f1b at world size 4: 1f1b needs at least one micro-batch per stage "
        "(--microbatches 2)", "pipeline interleaved, zbv at world size 4: 4 linear layers "
        "(--pipeline-layers 3) do not split evenly into 8 stages"]
    assert parse_args(["--device", "cpu"]).pipeline == []
    one_rank = parse_args(["--device", "cpu", "--max-world-size", "1", "--pipeline",
                           "gpipe"])
    _, _, skipped = plan_cases(one_rank, "cpu", CORES)
    assert any(line.startswith("pipeline (gpipe): one rank holds the whole model")
               for line in skipped), skipped


def test_pipeline_schedules_are_refused_only_where_torch_refuses_them():
    """Torch's own rules (torch/distributed/pipelining/schedules.py): Schedule1F1B wants a
    micro-batch per stage; ScheduleInterleaved1F1B only micro-batches that split into
    max(1, m // p) equal rounds, so p = 4 with m = 3 (its docstring's example) runs, and
    p = 2 with m = 3; p = 2 with m = 5 (rounds of 2) does not."""
    def problem(schedule, stages, microbatches, layers=15):
        args = parse_args(["--device", "cpu", "--pipeline", schedule, "--pipeline-layers",
                           str(layers), "--microbatches", str(microbatches),
                           "--batch-size", str(4 * microbatches)])
        return pipeline_problem(schedule, stages, args)

    assert problem("interleaved", 4, 3) is None
    assert problem("interleaved", 2, 3) is None
    assert problem("interleaved", 2, 1) is None
    assert problem("interleaved", 2, 5) == ("interleaved runs the micro-batches in 2 equal "
                                            "rounds (--microbatches 5 does not split into them)")
    assert problem("1f1b", 4, 3) == "1f1b needs at least one micro-batch per stage " \
                                    "(--microbatches 3)"
    assert problem("1f1b", 4, 4) is None and problem("gpipe", 4, 1) is None
    # ScheduleInterleavedZeroBubble keeps interleaved's rounds; ScheduleDualPipeV wants a
    # micro-batch per stage, two stages a rank.
    assert problem("zb1p", 2, 5) == ("zb1p runs the micro-batches in 2 equal rounds "
                                     "(--microbatches 5 does not split into them)")
    assert problem("zb1p", 2, 4) is None and problem("zbv", 2, 1) is None
    assert problem("dualpipev", 2, 3) == ("dualpipev needs at least one micro-batch per stage, "
                                          "4 (--microbatches 3)")
    assert problem("dualpipev", 2, 4) is None


def test_pipeline_speed_up_is_against_one_process_of_the_same_launch_and_simulation():
    """Two launches (2 and 4 ranks), each with its one process simulated and not: a row's
    speed-up divides by its own launch's and simulation's one process, never another's."""
    rows = [{"case": case, "processes": launch, "simulate_ms": ms, "stages": stages,
             "samples_per_s": rate, "bubble_formula": formula}
            for launch, ms, one, rate, formula in ((2, 10.0, 10.0, 15.0, 1 / 9),
                                                   (2, None, 400.0, 200.0, 1 / 9),
                                                   (4, 10.0, 8.0, 20.0, 3 / 11),
                                                   (4, None, 300.0, 60.0, 3 / 11))
            for case, stages, rate, formula in (("one-process", 1, one, 0.0),
                                                ("pipeline", launch, rate, formula))]
    rows = add_pipeline_speedups(rows)
    assert [r["speedup"] for r in rows] == pytest.approx([1, 1.5, 1, 0.5, 1, 2.5, 1, 0.2])
    assert [r.get("ideal_speedup") for r in rows] == [
        1, pytest.approx(16 / 9), None, None, 1, pytest.approx(32 / 11), None, None]
    # A row's bubble: the median of its repeats', with their spread, and the formula's.
    case = {"case": "pipeline", "schedule": "interleaved", "stages": 4, "chunks": 2,
            "microbatches": 8, "global_batch": 16, "steps": 2, "simulate_ms": 10.0}
    row = summarise_pipeline(case, [0.8, 1.6, 0.4], [3, 9, 15], [0.3, 0.2, 0.5], 4)
    assert (row["bubble"], row["bubble_min"], row["bubble_max"]) == (0.3, 0.2, 0.5)
    assert row["bubble_formula"] == pytest.approx(3 / 19)
    assert (row["samples_per_s"], row["samples_per_s_min"], row["samples_per_s_max"]) == \
        pytest.approx((40, 20, 80))


# Two gloo ranks forked from one process that imported the benchmark once: rank 1 never joins
# an all-reduce on make_group's group, and rank 0 must give up after that group's timeout (1 s),
# not new_group's 30-minute default, nor the launch's 20 s. Both then meet on the launch's group.
GROUP_TIMEOUT = """
import datetime, multiprocessing, os, sys, time
import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])  # benchmarks/, where scaling.py finds its bench package
from bench.ranks import find_free_port, make_group


def rank(r):
    dist.init_process_group("gloo", rank=r, world_size=2, timeout=datetime.timedelta(seconds=20))
    group = make_group(1, backend="gloo")
    if r == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(1), group=group)
        except RuntimeError as error:
            print(f"gave up after {time.monotonic() - start:.1f} s: {error}", flush=True)
    dist.barrier()
    os._exit(0)


os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
ranks = [multiprocessing.get_context("fork").Process(target=rank, args=(r,)) for r in (0, 1)]
for process in ranks:
    process.start()
for process in ranks:
    process.join()
print("exit codes", [process.exitcode for process in ranks])
"""


def test_a_group_of_the_benchmark_waits_no_longer_than_its_timeout():
    result = subprocess.run([sys.executable, "-c", GROUP_TIMEOUT, str(BENCHMARKS)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert "exit codes [0, 0]" in result.stdout, result.stdout + result.stderr
    waited = re.search(r"gave up after ([\d.]+) s: .*Timed out", result.stdout)
    # An order, not a threshold: the group's own 1 s ran out, before the launch's 20 s could.
    assert waited and 1 <= float(waited.group(1)) < 20, result.stdout


@pytest.mark.parametrize("failed, backend, call", [
    (True, "nccl", "abort"), (False, "nccl", "destroy"), (True, "gloo", "destroy")])
def test_a_rank_aborts_nccl_after_a_failure_and_destroys_otherwise(monkeypatch, failed, backend,
                                                                    call):
    """As the lessons' leave_group: NCCL's destroy would wait for collectives that the peers
    never join. Shown with the process group's calls recorded, since no NCCL runs here."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "destroy_process_group",
                        lambda group=None: calls.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda group=None: calls.append("abort"))
    leave_group(failed)
    assert calls == [call]


def test_bad_input_is_one_line_error(tmp_path):
    """As a learner types it: no traceback, one line that names the fix."""
    result = run_benchmark("--models", "alexnet", "--device", "cpu", "--out-dir", tmp_path,
                           timeout=60)
    assert_one_line_error(result, "--models: unknown alexnet")


@pytest.mark.parametrize("args, fragment", [
    (["--knobs", "fast"], "--knobs: unknown fast"),
    (["--tensor-parallel", "3d"], "--tensor-parallel: unknown 3d"),
    (["--allreduce-sizes", "lots"], "--allreduce-sizes"),
    (["--max-world-size", "0"], "--max-world-size must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--warmup", "0"], "--warmup must be at least 1"),
    (["--pipeline", "2f2b"], "--pipeline: unknown 2f2b"),
    (["--pipeline", "gpipe", "--microbatches", "3"], "--microbatches 3 does not divide "
                                                     "--batch-size 16"),
    (["--simulate-ms", "-1"], "--simulate-ms must be at least 0"),
    (["--pipeline-layers", "0"], "--pipeline-layers must be at least 1"),
])
def test_bad_arguments_stop_with_one_line(args, fragment):
    """The same check as above for every other flag, in this process: parse_args stops through
    fail(), whose SystemExit message is the line the command prints."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*args, "--device", "cpu"])
    message = str(exit_info.value)
    assert message.startswith("error: ") and "\n" not in message, message
    assert fragment in message, message


def test_defaults_per_device():
    """GPU-sized work on CUDA; the CPU's small, fast defaults; 5 repeats (3 with --quick)."""
    pick = ("batch_size", "image_size", "precision", "channels_last", "steps", "warmup",
            "repeats")

    def defaults(*args):
        settings = default_settings(*args)
        return tuple(settings[name] for name in pick)

    assert defaults("cuda", False, True) == (256, 224, "bf16", True, 20, 10, 5)
    assert defaults("cuda", True, True) == (256, 224, "bf16", True, 10, 5, 3)
    # A GPU without native bf16 (compute capability below 8.0) keeps fp32.
    assert defaults("cuda", False, False) == (256, 224, "fp32", True, 20, 10, 5)
    assert defaults("cpu", False) == (16, 112, "fp32", False, 6, 3, 5)
    assert defaults("cpu", True) == (8, 64, "fp32", False, 4, 2, 3)


@pytest.fixture
def pretend_gpus(monkeypatch):
    """parse_args and plan_cases as on a machine with n GPUs of compute capability 9.0."""

    def with_gpus(count, capability=(9, 0)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)

    return with_gpus


def test_gpu_arguments_default_to_gpu_sized_work(pretend_gpus):
    pretend_gpus(2)
    args = parse_args([])
    assert (args.device_type, args.max_world_size) == ("cuda", 2)
    assert (args.batch_size, args.image_size, args.precision, args.channels_last) == \
        (256, 224, "bf16", True)
    args = parse_args(["--precision", "fp32", "--no-channels-last", "--batch-size", "64",
                       "--image-size", "112"])
    assert (args.batch_size, args.image_size, args.precision, args.channels_last) == \
        (64, 112, "fp32", False)
    args = parse_args(["--device", "cpu"])
    assert (args.device_type, args.batch_size, args.image_size, args.precision,
            args.channels_last) == ("cpu", 16, 112, "fp32", False)


def test_bf16_on_a_gpu_without_it_is_one_line_error(pretend_gpus, capsys):
    pretend_gpus(1, capability=(7, 0))
    args = parse_args([])
    assert args.precision == "fp32" and "no native bf16" in args.precision_note
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--precision", "bf16"])
    assert str(exit_info.value).startswith("error: --precision bf16 needs")
    assert "has 7.0: use --precision fp32" in str(exit_info.value)


def test_one_gpu_measures_no_dataparallel_no_bandwidth_and_no_knobs(pretend_gpus):
    pretend_gpus(1)
    args = parse_args([])
    plan, backend, skipped = plan_cases(args, "cuda", CORES)
    cases = [case for cases in plan.values() for case in cases]
    assert backend == "nccl" and list(plan) == [1]
    assert {(c["model"], c["case"]) for c in cases} == {
        (model, case) for model in ("wine-mlp", "resnet18")
        for case in ("plain", "ddp", "zero1", "fsdp")}
    assert all(c["knob"] is None for c in cases)
    reasons = " | ".join(skipped)
    for fragment in ("nn.DataParallel", "all-reduce bandwidth", "DDP knobs", "nothing to shard"):
        assert fragment in reasons, reasons


def test_two_gpus_plan_dataparallel_bandwidth_and_knobs_at_two(pretend_gpus):
    pretend_gpus(2)
    args = parse_args([])
    plan, _, skipped = plan_cases(args, "cuda", CORES)
    cases = [case for cases in plan.values() for case in cases]
    # Only lesson 09's layouts that 2 GPUs cannot have: tp on 1, 2d below 4, none on ResNet-18.
    assert [line.split(":")[0] for line in skipped] == [
        "resnet18 tp, 2d", "wine-mlp tp at world size(s) 1", "wine-mlp 2d at world size(s) 1, 2"]
    assert [(c["model"], c["case"], c["world_size"], c["global_batch"]) for c in cases
            if c["case"] in ("tp", "2d")] == [("wine-mlp", "tp", 2, 256)]
    assert {c["world_size"] for c in cases if c["case"] == "dataparallel"} == {2}
    assert {(c["backend"], c["world_size"]) for c in cases if c["case"] == "allreduce"} == \
        {("nccl", 2), ("gloo", 2)}
    assert {c["world_size"] for c in cases if c.get("knob") is not None} == {2}
    # Per worker and its ceiling are CPU questions: on GPUs each rank has a device of its own.
    assert not [c for c in cases if c["case"] in ("ddp-per-worker", "ceiling")]
    # The noise check's case, the plain model on 1 GPU, first and last in the last launch.
    assert [(c["model"], c["case"], c["world_size"], c["noise_check"])
            for c in (plan[2][0], plan[2][-1])] == \
        [("resnet18", "plain", 1, "start"), ("resnet18", "plain", 1, "end")]
    assert not [c for c in plan[1] if c.get("noise_check")]
    assert {(c["case"], c["world_size"]) for c in cases if c["case"] in ("zero1", "fsdp")} == \
        {(case, n) for case in ("zero1", "fsdp") for n in (1, 2)}
    for case in (c for c in cases if c["case"] != "allreduce"):
        images = case["model"] == "resnet18"
        # FSDP2 cannot shard channels_last weights: its rows keep the default layout.
        assert (case["batch_per_rank"], case["precision"], case["channels_last"]) == \
            (256, "bf16" if images else "fp32", images and case["case"] != "fsdp"), case
        assert case["image_size"] == (224 if images else None), case


def test_lesson08_modes_are_planned_beside_ddp_per_worker_and_the_ceiling():
    """--grad-sync: lesson 08's modes on ResNet-18 in the largest launch, with the per-worker
    threads, so that they are measured in the same rounds as ddp-per-worker and the ceiling;
    none by default, so that the default run's time does not grow."""
    args = parse_args(["--device", "cpu", "--max-world-size", "2", "--grad-sync",
                       "after-backward,buckets,ddp", "--knobs", "none"])
    plan, _, _ = plan_cases(args, "cpu", CORES)
    lesson = [c for c in plan[2] if c["case"] == "lesson08"]
    assert [(c["model"], c["knob"], c["knob_value"], c["world_size"]) for c in lesson] == \
        [("resnet18", "grad_sync", mode, 2) for mode in ("after-backward", "buckets", "ddp")]
    per_worker = next(c for c in plan[2] if c["case"] == "ddp-per-worker")
    assert all(c["threads_per_rank"] == per_worker["threads_per_rank"] for c in lesson)
    assert case_name(lesson[1]) == "lesson08 buckets"
    default = parse_args(["--device", "cpu"])
    assert default.grad_sync == []
    with pytest.raises(SystemExit, match="--grad-sync: unknown fast"):
        parse_args(["--device", "cpu", "--grad-sync", "fast"])


def test_channels_last_converts_the_weights_and_the_images():
    device = torch.device("cpu")
    features = torch.randn(2, 3, 32, 32)
    for channels_last in (False, True):
        model, images = prepare(build_model("resnet18"), features,
                                        {"channels_last": channels_last}, device)
        assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last) == \
            channels_last
        assert images.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_autocast_dtype_is_per_thread_so_dataparallel_gets_it_in_forward():
    """nn.DataParallel runs each replica in a thread of its own and re-enters autocast there
    without a dtype. Autocast's dtype is thread-local, so a new thread sees CUDA's default,
    float16, even while the caller asked for bf16 (no GPU needed to see it: it is the state
    autocast would use). AutocastForward enters bf16 autocast in the calling thread itself."""
    seen = {}
    before = torch.get_autocast_dtype("cuda")
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        thread = threading.Thread(target=lambda: seen.update(
            cuda=torch.get_autocast_dtype("cuda")))
        thread.start()
        thread.join()
    finally:
        torch.set_autocast_dtype("cuda", before)
    assert seen["cuda"] == torch.float16

    # The wrapper, on the CPU (autocast on its input's device), in a new thread whose default
    # autocast dtype is float16, as a DataParallel replica's thread is on CUDA: it runs bf16.
    wrapped = AutocastForward(torch.nn.Linear(4, 2))

    def replica():
        torch.set_autocast_dtype("cpu", torch.float16)
        with torch.autocast("cpu", enabled=True):  # what parallel_apply enters: no dtype
            seen["out"] = wrapped(torch.randn(3, 4)).dtype

    thread = threading.Thread(target=replica)
    thread.start()
    thread.join()
    assert seen["out"] == torch.bfloat16

    # DataParallel gets the wrapper with bf16, and only then. (Built on the CPU, DataParallel
    # keeps its module and drives no device; what matters here is what it wraps.)
    for precision, wrapper in (("bf16", True), ("fp32", False)):
        case = {"case": "dataparallel", "world_size": 2, "precision": precision}
        model = wrap_model(torch.nn.Linear(4, 2), case, torch.device("cpu"))
        assert isinstance(model, torch.nn.DataParallel)
        assert isinstance(model.module, AutocastForward) == wrapper


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; none is visible on this machine")
def test_gpu_run_has_nccl_dataparallel_and_gloo_on_gpu_tensors(tmp_path):
    world = min(GPUS, 2)
    result = run_benchmark(*TINY, "--device", "cuda", "--max-world-size", world,
                           "--out-dir", tmp_path)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    rows, _ = read_rows(tmp_path, "results")
    assert {(r["backend"], r["device"]) for r in rows} == {("nccl", "cuda")}
    resnet = [r for r in rows if r["model"] == "resnet18"]
    precision = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp32"
    # channels_last on every ResNet-18 row but FSDP's: fully_shard refuses channels_last
    # weights (tools/repro_fsdp_channels_last.py), so those rows keep the default layout.
    assert any(r["case"] == "fsdp" for r in resnet)
    for row in resnet:
        assert (row["precision"], row["channels_last"]) == (precision, row["case"] != "fsdp"), row
        assert row["repeats"] == REPEATS and \
            row["samples_per_s_min"] <= row["samples_per_s"] <= row["samples_per_s_max"], row
    ddp1 = next(r for r in resnet if r["case"] == "ddp" and r["world_size"] == 1)
    assert isinstance(ddp1["ddp_cost_pct"], float)
    # Each rank's peak, from torch.cuda.max_memory_allocated, at least what it holds.
    for row in (r for r in rows if r["case"] in ("ddp", "zero1", "fsdp")):
        held = row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"]
        assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] >= held, row
        # The case's own tensors: cuBLAS's workspaces (8 MiB by default, 32 MiB on recent GPUs)
        # were made before the first case (make_cublas_workspaces), so the wine MLP's few
        # kilobytes are all its peak shows.
        if row["model"] == "wine-mlp":
            assert row["peak_bytes"] < 4 << 20, row
    fsdp = next(r for r in resnet if r["case"] == "fsdp" and r["world_size"] == world)
    assert fsdp["channels_last"] is False and fsdp["parameter_bytes"] <= \
        ddp1["parameter_bytes"] / world + 4 * 2**20
    # DataParallel, knobs and bandwidth only where there are 2 GPUs to measure them on.
    assert {r["world_size"] for r in rows if r["case"] == "dataparallel"} == \
        set(range(2, world + 1))
    assert all(r["samples_per_s"] > 0 for r in rows)
    bandwidth, _ = read_rows(tmp_path, "allreduce")
    assert {r["backend"] for r in bandwidth} == ({"nccl", "gloo"} if world > 1 else set())
    if world == 1:
        assert "skipped: nn.DataParallel" in result.stdout
    # The noise check ran on GPU 0 in the last launch, its other ranks waiting.
    with open(tmp_path / "run.json") as f:
        check = json.load(f)["noise_check"]
    assert (check["start_processes"], check["end_processes"]) == (world, world), check
