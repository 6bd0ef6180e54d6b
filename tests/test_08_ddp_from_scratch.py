"""Lesson 08, run as a learner runs it: python 08_ddp_from_scratch/train.py (mp.spawn, gloo/CPU),
and torchrun.

Every home-made gradient synchronisation ends on the weights of DDP, and of lesson 02; the
all-reduces are counted in a profiler trace of one step, which also shows which modes overlap
them with backward. Comparing six modes at three world sizes would take 18 lesson runs; instead
tests/every_grad_sync.py starts the ranks once per world size and calls the lesson's main() for
every mode in turn on them. The GPU tier (NCCL) is at the end of this file."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import (
    GPUS,
    NO_GPUS,
    ROOT,
    assert_good_run,
    assert_one_line_error,
    check_ok,
    evaluate_single_process,
    import_lesson,
    lesson02_run,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
)

LESSON = "08_ddp_from_scratch"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
HOME_MADE = ["after-backward", "flat", "overlap", "buckets"]
MODES = [*HOME_MADE, "ddp", "none"]
# The wine MLP with lesson 02's flags for 2 ranks (LESSON02_RUNS): batch 16 per rank; its four
# tensors make one bucket. With 2 ranks, a profile of step 2, after DDP has rebuilt its buckets
# (as it does without find_unused_parameters).
WINE = [*CPU, "--batch-size", 16]
PROFILE = ["--profile-step", 2]
# A larger model, 12,664,844 bytes of gradients: 4 buckets of 1 MiB (the README's arithmetic).
LARGE_MODEL = ["--batch-size", 16, "--hidden", 1024, "--layers", 4, "--bucket-mb", 1,
               "--lr", 0.001, "--epochs", 1, "--profile-step", 3]
LARGE = [*CPU, *LARGE_MODEL]
LARGE_TENSORS, LARGE_BUCKETS = 10, 4
# With 3 ranks gloo adds three numbers per element, in an order that depends on where the element
# sits in the buffer, and DDP divides by 3 before the sum where the others divide after: the modes
# end within a few float32 roundings of each other (1.2e-7 measured), not bitwise.
TOLERANCE = 1e-5
# What torch.profiler records (torch 2.14, gloo): each all-reduce's launch as the c10d operator,
# on the thread that calls it; the transfer as gloo's work, on one of gloo's own threads.
LAUNCH, TRANSFER = "c10d::allreduce_", "gloo:all_reduce"


def run_every_mode(out_dir, *groups, env=NO_GPUS):
    """tests/every_grad_sync.py: every mode, for each (name, flags) group, on the same ranks."""
    command = [sys.executable, str(ROOT / "tests" / "every_grad_sync.py"), str(out_dir)]
    for i, (name, flags) in enumerate(groups):
        command += [*(["::"] if i else []), name, *map(str, flags)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result


class RunsByWorldSize(dict):
    """{world size: folder}, each world size launched the first time a test asks for it: a
    test of 2 ranks alone (the mutation check runs one at a time) waits for no other."""

    def __init__(self, launch):
        super().__init__()
        self.launch = launch

    def __missing__(self, world_size):
        self[world_size] = self.launch(world_size)
        return self[world_size]


@pytest.fixture(scope="module")
def every_mode(tmp_path_factory):
    """{world size: folder}: folder/<group>/<mode>/ holds that mode's run. 2 ranks: the wine
    MLP and the larger model, each with a profile of one step, and folder/cases.json, the
    models of tests/grad_sync_cases.py; 1 and 3 ranks: the wine MLP."""
    def launch(world_size):
        out_dir = tmp_path_factory.mktemp(f"lesson08_{world_size}_ranks")
        profile = PROFILE if world_size == 2 else []  # the tests read the profiles of 2 ranks
        groups = [("wine", [*WINE, *profile, "--world-size", world_size])]
        if world_size == 2:
            groups += [("large", [*LARGE, "--world-size", world_size]), ("cases", [])]
        run_every_mode(out_dir, *groups)
        return out_dir

    return RunsByWorldSize(launch)


def step_trace(out_dir, rank):
    """One rank's profile of one step: (the "backward" span, its gradient computations, the
    all-reduce launches, the all-reduce transfers), each a list of events sorted by start."""
    trace = json.loads((out_dir / f"trace_rank{rank}.json").read_text())
    events = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
    (backward,) = [e for e in events if e["name"] == "backward"]
    # Autograd's nodes (AddmmBackward0, ReluBackward0, ...) run on the thread that called
    # backward, on the CPU.
    gradients = [e for e in events if e["tid"] == backward["tid"]
                 and e["name"].endswith("Backward0")]
    launches = [e for e in events if e["name"] == LAUNCH]
    transfers = [e for e in events if e["name"] == TRANSFER]
    return backward, gradients, launches, transfers


def end(event):
    return event["ts"] + event["dur"]


# ---------------------------------------------------------------------------------------------
# The default run, as a learner types it, and torchrun
# ---------------------------------------------------------------------------------------------
def test_default_run_is_buckets_and_writes_lesson_01s_model(lesson_run):
    result, out_dir = lesson_run(LESSON, env=NO_GPUS)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert (metrics["grad_sync"], metrics["backend"], metrics["hidden"]) == ("buckets", "gloo", 64)
    # The four tensors of the wine MLP (4,364 bytes) fit in one bucket of 25 MiB.
    assert "gradient all-reduces per step: 1" in result.stdout
    assert "  bucket 0 (4,364 bytes): fc2.bias fc2.weight fc1.bias fc1.weight" in result.stdout
    assert "samples/s over all ranks, 60 optimizer steps" in result.stdout
    # final.pt loads into lesson 01's model, which counts the test wines as the ranks did.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


def test_torchrun_takes_the_steps_of_mp_spawn(lesson_run, tmp_path):
    result = run_torchrun(LESSON, "--out-dir", tmp_path, env=NO_GPUS)
    metrics = assert_good_run(result, tmp_path, world_size=2, min_accuracy=0.95)
    assert "starting 2 ranks" not in result.stdout  # mp.spawn's line: torchrun started them
    spawned = lesson_run(LESSON, env=NO_GPUS)[1]
    assert metrics["train_loss"] == read_metrics(spawned)["train_loss"]
    assert max_weight_difference(tmp_path, spawned) == 0


# ---------------------------------------------------------------------------------------------
# The same weights as DDP, and the control that shows the comparison can fail
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_mode_ends_on_ddps_weights(every_mode, world_size):
    runs = every_mode[world_size] / "wine"
    for mode in MODES:
        assert read_metrics(runs / mode)["test_total"] == 36
    for mode in HOME_MADE:
        difference = max_weight_difference(runs / mode, runs / "ddp")
        if world_size < 3:
            # One rank sums nothing; two add a + b, the same on every order, and halving is
            # exact: every mode takes DDP's steps to the last bit.
            assert difference == 0, mode
        else:
            assert difference < TOLERANCE, mode
    # overlap all-reduces the same tensors as after-backward and divides alike, only sooner:
    # the same numbers in the same order, bitwise, at any world size.
    assert max_weight_difference(runs / "overlap", runs / "after-backward") == 0


def test_every_mode_ends_on_lesson_02s_weights(lesson_run, every_mode):
    # Lesson 02's own run (2 ranks x batch 16): DDP there, each home-made mode here, bitwise.
    _, lesson02 = lesson02_run(lesson_run, 2)
    for mode in [*HOME_MADE, "ddp"]:
        assert max_weight_difference(every_mode[2] / "wine" / mode, lesson02) == 0, mode


@pytest.mark.parametrize("world_size", [2, 3])
def test_control_without_gradient_sync_fails_the_comparison(every_mode, world_size):
    runs = every_mode[world_size] / "wine"
    # Each rank steps with its own gradients: rank 0's weights are those of its slice alone.
    assert max_weight_difference(runs / "none", runs / "ddp") > 1e-2


def test_every_rank_starts_from_rank_0s_weights(every_mode):
    # every_grad_sync.py shifts rank r's initial weights by r before make_grad_sync; its
    # broadcast (DDP's, for ddp) brings every rank back to rank 0's.
    for world_size, shift in ((2, 1.0), (3, 2.0)):
        initial = json.loads((every_mode[world_size] / "wine" / "initial_weights.json").read_text())
        assert initial == {mode: {"before": shift, "after": 0.0} for mode in MODES}


# ---------------------------------------------------------------------------------------------
# The all-reduces, counted in a profile of one step, and the buckets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group, tensors, buckets", [("wine", 4, 1),
                                                     ("large", LARGE_TENSORS, LARGE_BUCKETS)])
def test_all_reduces_per_step_are_counted_in_the_profile(every_mode, group, tensors, buckets):
    expected = {"after-backward": tensors, "flat": 1, "overlap": tensors, "buckets": buckets,
                "ddp": buckets, "none": 0}
    for mode, count in expected.items():
        runs = every_mode[2] / group / mode
        for rank in (0, 1):
            _, _, launches, transfers = step_trace(runs, rank)
            assert len(launches) == len(transfers) == count, (mode, rank)
        # What the lesson prints and writes is what the profiler saw (DDP does not say).
        assert read_metrics(runs)["all_reduces_per_step"] == (None if mode == "ddp" else count)


def test_buckets_are_planned_as_ddp_plans_them(every_mode):
    for group in ("wine", "large"):
        runs = every_mode[2] / group
        plan = read_metrics(runs / "buckets")["buckets"]
        # DDP's own buckets after its rebuild, in the order backward produced the gradients.
        assert plan == json.loads((runs / "ddp" / "ddp_buckets.json").read_text())
    assert plan == [["fc2.bias", "fc2.weight", "hidden.2.bias", "hidden.2.weight"],
                    ["hidden.1.bias", "hidden.1.weight"], ["hidden.0.bias", "hidden.0.weight"],
                    ["fc1.bias", "fc1.weight"]]


@pytest.mark.parametrize("bucket_mb, sizes", [
    (25, [12_664_844]),                      # all of it: less than 25 MiB
    (5, [8_409_100, 4_255_744]),             # the first closes at hidden.1.weight, over 5 MiB
    (1, [4_210_700, 4_198_400, 4_198_400, 57_344]),  # each 4 MiB weight closes a bucket
])
def test_bucket_sizes_follow_the_readmes_arithmetic(bucket_mb, sizes):
    lesson = import_lesson(LESSON)
    model = lesson.WineMLP(hidden=1024, layers=4)
    buckets = lesson.plan_buckets(model, bucket_mb)
    assert [sum(p.numel() * 4 for _, p in bucket) for bucket in buckets] == sizes


def test_overlap_is_shown_in_the_profile(every_mode):
    # The larger model, 4 buckets: in overlap, buckets and ddp every rank launches the first
    # all-reduce while backward still computes the gradients of the layers below;
    # after-backward and flat launch theirs only once backward has ended, on every rank too.
    # When gloo's thread begins the transfer is the OS's choice: with one core per rank it
    # shares that core with backward, and on a busy machine rank 1's began 0.13 ms after
    # backward's last gradient once (CI). So the transfer must begin during backward on at
    # least one rank.
    for mode in ("overlap", "buckets", "ddp", "after-backward", "flat"):
        during = []
        for rank in (0, 1):
            backward, gradients, launches, transfers = step_trace(
                every_mode[2] / "large" / mode, rank)
            if mode in ("after-backward", "flat"):
                assert launches[0]["ts"] >= end(backward), (mode, rank)
            else:
                assert launches[0]["ts"] < gradients[-1]["ts"], (mode, rank)
                during.append(transfers[0]["ts"] < end(gradients[-1]))
        assert mode in ("after-backward", "flat") or any(during), mode


# ---------------------------------------------------------------------------------------------
# Models unlike the wine MLP (tests/grad_sync_cases.py): safe to copy, or stopped in one line
# ---------------------------------------------------------------------------------------------
def cases(every_mode, case):
    return json.loads((every_mode[2] / "cases.json").read_text())[case]


def test_buckets_never_mix_dtypes_as_ddps_never_do():
    # DDP's own planner, on the parameters in the order backward produces their gradients:
    # it keys its buckets by dtype and device and, given no order of its own, sorts them by
    # their first parameter. A bfloat16 layer among float32 ones, under caps that close none,
    # some and every bucket.
    lesson = import_lesson(LESSON)
    model = lesson.WineMLP(hidden=32, layers=4)
    model.hidden[1].to(torch.bfloat16)
    named = list(reversed(list(model.named_parameters())))
    for bucket_mb in (25, 0.004, 1e-6):
        plan = [[name for name, _ in bucket] for bucket in lesson.plan_buckets(model, bucket_mb)]
        ddps, _ = dist._compute_bucket_assignment_by_size(
            [param for _, param in named], [int(bucket_mb * 1024 * 1024)], [False] * len(named))
        assert plan == [[named[i][0] for i in bucket] for bucket in ddps], bucket_mb
    assert lesson.plan_buckets(model, 25)[1] == [("hidden.1.bias", model.hidden[1].bias),
                                                 ("hidden.1.weight", model.hidden[1].weight)]


def test_a_bfloat16_layer_ends_on_ddps_weights(every_mode):
    # A float32 layer, then a bfloat16 one, whose gradients backward produces first: in one
    # bucket of bfloat16, the float32 gradients would lose 16 bits of precision.
    results = cases(every_mode, "dtypes")
    # DDP's buckets after its rebuild, in another order: DDP lists the buckets still open when
    # its planner ends in the order of a hash map's keys (compute_bucket_assignment_by_size),
    # the lesson in the order of their first gradients.
    assert results["plan"] == [["fc2.bias", "fc2.weight"], ["fc1.bias", "fc1.weight"]]
    assert sorted(results["plan"]) == sorted(results["ddp"]["buckets"])
    for mode in HOME_MADE:
        assert results[mode]["difference"] == 0, mode
    assert (results["flat"]["all_reduces"], results["buckets"]["all_reduces"]) == (2, 2)


def test_parameters_without_gradients_are_zeros_on_every_rank(every_mode):
    # Rank 0 skips layer a, rank 1 layer b, no rank uses layer never; one layer per bucket. Every
    # mode sends every gradient, zeros for the missing, in one order on both ranks, and ends on
    # the weights of DDP with find_unused_parameters=True (the test's time limit bounds a hang).
    results = cases(every_mode, "unused")
    for mode in HOME_MADE:
        assert (results[mode]["difference"], results[mode]["error"]) == (0, None), mode
    assert [results[mode]["all_reduces"] for mode in HOME_MADE] == [8, 1, 8, 4]


def test_gradients_are_divided_before_the_sum(every_mode):
    # Each rank's float16 gradient is 40,000: summed first, 80,000 is past fp16's 65,504 (inf);
    # divided first, as DDP does, the mean is 40,000 in every mode.
    results = cases(every_mode, "fp16")
    assert results["ddp"]["finite"]
    for mode in HOME_MADE:
        assert results[mode]["difference"] == 0, mode


def test_a_second_backward_before_finish(every_mode):
    # after-backward and flat read the gradients once, in finish(): two backwards accumulate,
    # as under DDP's no_sync. overlap and buckets send them during backward: stopped in a line.
    results = cases(every_mode, "twice")
    for mode in ("after-backward", "flat"):
        assert (results[mode]["difference"], results[mode]["error"]) == (0, None), mode
    for mode in ("overlap", "buckets"):
        assert results[mode]["error"].startswith(
            "error: fc2.bias's gradient hook fired twice before finish(): call finish() after "
            "every backward"), mode


# ---------------------------------------------------------------------------------------------
# Flags that cannot work
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["--bucket-mb", "0"], "--bucket-mb must be positive (got 0)"),
    (["--layers", "0"], "--layers must be at least 1 (got 0)"),
    (["--hidden", "-1"], "--hidden must be at least 1 (got -1)"),
    (["--profile-step", "0"], "--profile-step must be at least 1 (got 0)"),
])
def test_flags_that_cannot_work_are_refused_in_one_line(args, fragment):
    with pytest.raises(SystemExit) as stop:
        import_lesson(LESSON).parse_args(args)
    assert str(stop.value) == f"error: {fragment}"


def test_bad_input_stops_before_any_rank_starts(tmp_path):
    result = run_lesson(LESSON, "--bucket-mb", "-1", "--out-dir", tmp_path)
    assert_one_line_error(result, "--bucket-mb must be positive")
    assert "starting" not in result.stdout


# ---------------------------------------------------------------------------------------------
# The GPU tier: NCCL, one GPU per rank
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; none is visible here")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")


@pytest.mark.gpu
@needs_gpu
def test_gpu_default_run_is_a_rank_per_gpu_and_saves_for_the_cpu(lesson_run):
    result, out_dir = lesson_run(LESSON)
    metrics = assert_good_run(result, out_dir, world_size=GPUS)
    assert (metrics["backend"], metrics["device"], metrics["grad_sync"]) == (
        "nccl", "cuda", "buckets")
    # final.pt holds CPU tensors: it loads without map_location on a machine without a GPU.
    saved = torch.load(out_dir / "final.pt", weights_only=True)
    assert {tensor.device.type for tensor in saved.values()} == {"cpu"}
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


@pytest.mark.gpu
@needs_gpu
def test_gpu_larger_model_launches_its_buckets_during_backward(tmp_path):
    # The larger model's 4 buckets of 1 MiB on one GPU per rank (1 or 2 of them), with a
    # profile of step 3. With CUDA, autograd runs backward, and the hooks, on a thread of its
    # own, so every Backward0 node counts here, whatever its thread.
    world_size = min(GPUS, 2)
    result = check_ok(run_lesson(LESSON, *LARGE_MODEL, "--backend", "nccl", "--world-size",
                                 world_size, "--out-dir", tmp_path))
    assert f"gradient all-reduces per step: {LARGE_BUCKETS}" in result.stdout
    for rank in range(world_size):
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        gradients = sorted(e["ts"] for e in events if e["name"].endswith("Backward0"))
        launches = sorted(e["ts"] for e in events if e["name"] == LAUNCH)
        assert len(launches) == LARGE_BUCKETS, rank
        assert launches[0] < gradients[-1], rank  # the first bucket leaves during backward


@pytest.mark.gpu
@needs_gpu
@needs_two
def test_gpu_every_mode_ends_on_ddps_weights_bitwise(tmp_path):
    # NCCL: the all-reduces run on NCCL's stream, and work.wait() makes the current stream
    # wait. Two ranks add a/2 + b/2, exact in any order, as DDP does: the same bits.
    run_every_mode(tmp_path, ("wine", ["--backend", "nccl", "--world-size", 2,
                                       "--batch-size", 16]), env={})
    for mode in HOME_MADE:
        assert max_weight_difference(tmp_path / "wine" / mode, tmp_path / "wine" / "ddp") == 0
    assert max_weight_difference(tmp_path / "wine" / "none", tmp_path / "wine" / "ddp") > 1e-2
